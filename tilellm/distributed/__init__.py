"""Tensor parallelism over torch.distributed: one process per rank, rank 0 in the user's process.

Rank 0 (the driver) runs the engine: scheduler, sampler, detokenizer. Every step it broadcasts
the step's model inputs (`message.py`: a 13-word header over gloo, then one flat int64 payload
over the default group, NCCL on CUDA) and runs its own shard of the model on them; the other
ranks (`worker.py`) run theirs on the same bytes. The layers' all-reduces and the LM head's
all-gather keep the ranks' activations equal, so only rank 0 samples. `driver.py` starts,
watches and stops the workers; `group.py` is the process group as one rank sees it.
"""

from tilellm.distributed.driver import TPDriver, WorkerError, check_tensor_parallel, start_tensor_parallel
from tilellm.distributed.group import TPGroup

__all__ = ["TPDriver", "TPGroup", "WorkerError", "check_tensor_parallel", "start_tensor_parallel"]
