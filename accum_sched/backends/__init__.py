"""How gradients meet: one written interface (:mod:`.base`), one module per back end, one registry that chooses.

=================  ==========================================================================================
module             what
=================  ==========================================================================================
``base``           :class:`Backend` (the interface), :class:`Capabilities`
``registry``       :func:`make_backend`, the ordered table of back ends and their "is this model mine?"
``detect``         those predicates, import-free (DeepSpeed by name, FSDP2 through ``sys.modules``)
``torch_optim``    :class:`TorchBackend`: gradients in ``.grad``, a torch optimizer (base of the next three)
``single``         one process
``ddp``            DistributedDataParallel with ``no_sync``, its comm hook (``ddp_hook``) or carrier (``ddp_carrier``)
``fsdp``           FSDP2 (``fully_shard``), imported only for an FSDP2 model
``deepspeed``      a DeepSpeedEngine, imported only for one (DeepSpeed itself only inside its functions)
``counting``       a counting-only DDP comm hook for hand-written loops (benchmarks, tests)
=================  ==========================================================================================

See docs/backends.md. Importing this package imports neither DeepSpeed nor FSDP2.
"""
from accum_sched.backends.base import Backend, Capabilities
from accum_sched.backends.detect import is_deepspeed_engine
from accum_sched.backends.registry import REGISTRY, backend_class, make_backend

__all__ = [
           "REGISTRY",
           "Backend",
           "Capabilities",
           "backend_class",
           "is_deepspeed_engine",
           "make_backend",
]
