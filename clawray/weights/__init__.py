"""Moving weights from the learner into every serving replica (``docs/weights.md``).

``sync.py`` (the ``WeightSync`` transports and their registry), ``nccl.py`` (vLLM's NCCL
transport), ``control.py`` (a channel's ``AppControl`` actor), ``receiver.py`` (the replica's
``WeightReceiver``), ``publisher.py`` (the learner side's ``WeightPublisher``). The transports'
API is importable from here, as it was from the former ``clawray/weights.py``.
"""

from clawray.weights.sync import (LORA_FORMAT, LoraSync, ObjectStoreSync, WeightSync,
                                  WeightSyncError, check_state, copy_baseline, lora_payload,
                                  lora_payload_from_state_dict, make_weight_sync, merge_lora,
                                  register_weight_sync, state_nbytes)

__all__ = ["LORA_FORMAT", "LoraSync", "ObjectStoreSync", "WeightSync", "WeightSyncError",
           "check_state", "copy_baseline", "lora_payload", "lora_payload_from_state_dict",
           "make_weight_sync", "merge_lora", "register_weight_sync", "state_nbytes"]
