"""The sample buffer: ``core.py`` (``SampleBufferCore``: sealing, the Parquet write-ahead log,
the queue, exact-N takes, recovery; no Ray) and ``actor.py`` (the ``SampleBuffer`` actor).
The core's API is importable from here, as it was from the former ``clawray/buffer.py``."""

from clawray.buffer.core import (SampleBufferCore, SealJob, Slice, fetch, fetch_from_wal,
                                 read_segment, segment_name)

__all__ = ["SampleBufferCore", "SealJob", "Slice", "fetch", "fetch_from_wal", "read_segment",
           "segment_name"]
