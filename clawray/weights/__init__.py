"""Moving weights from the learner into every serving replica (``docs/weights.md``).

``sync.py`` (the ``WeightSync`` transports and their registry), ``nccl.py`` (vLLM's NCCL
transport), ``control.py`` (a channel's ``AppControl`` actor), ``receiver.py`` (the replica's
``WeightReceiver``), ``publisher.py`` (the learner side's ``WeightPublisher``). The transports'
API is importable from here, as it was from the former ``clawray/weights.py``.
"""

from clawray.weights.sync import (LoraSync, ObjectStoreSync, WeightSync, WeightSyncError,
                                  check_state, copy_baseline, make_weight_sync, merge_lora,
                                  register_weight_sync, state_nbytes)

__all__ = ["LoraSync", "ObjectStoreSync", "WeightSync", "WeightSyncError", "check_state",
           "copy_baseline", "make_weight_sync", "merge_lora", "register_weight_sync",
           "state_nbytes"]
