"""cuda_oom.py [REPLICA]: REPLICA runs out of accelerator memory (torch.OutOfMemoryError,
raised as a CUDA allocation would raise it) inside @rt.record; the others wait."""
import _common
import torch

import resilient_train as rt


@rt.record
def train_step() -> None:
    raise torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
        "79.14 GiB of which 3.12 GiB is free.")


_common.start()
if _common.targeted(1):
    train_step()
_common.hang()
