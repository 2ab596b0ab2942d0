"""Tensor parallelism over torch.distributed: one process per rank, rank 0 in the user's process.

Rank 0 (the driver) runs the engine: scheduler, sampler, detokenizer. Every step it broadcasts
the step's model inputs (`tilellm.worker.step_inputs`: a header over gloo, then one flat int64
payload over the default group, NCCL on CUDA) and runs its own shard of the model on them; the
other ranks (`tilellm.worker.tp_worker`) run theirs on the same bytes. The layers' all-reduces
and the LM head's all-gather keep the ranks' activations equal, so only rank 0 samples. `driver.py` starts,
watches and stops the workers; `group.py` is the process group as one rank sees it. This
package knows nothing of models or steps: the device side (`tilellm.worker`) uses it.
"""

from tilellm.distributed.driver import TPDriver, WorkerError, check_tensor_parallel, start_tensor_parallel
from tilellm.distributed.group import TPGroup

__all__ = ["TPDriver", "TPGroup", "WorkerError", "check_tensor_parallel", "start_tensor_parallel"]
