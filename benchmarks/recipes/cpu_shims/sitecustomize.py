"""CPU-only workaround for the recipe runs (benchmarks/recipes/run.py puts this folder on
PYTHONPATH for the DeepSpeed run and the veScale run alike; Python imports sitecustomize at
start-up).

Accelerate 1.13 (axolotl's pin) picks a distributed backend only for an accelerator (CUDA, XPU,
...) or when told `cpu=True`; a launched rank on a machine without one gets no backend, so
`PartialState` counts 1 process while DeepSpeed runs 2 ("train_batch_size is not equal to
micro_batch_per_gpu * gradient_acc_step * world_size 4 != 2 * 2 * 2"). And `cpu=True` would
skip its DeepSpeed path altogether. Here a launched rank (LOCAL_RANK set, cpu not asked) that
got no backend gets gloo, as Accelerate 1.11 (LLaMA-Factory's pin) already chooses on its own,
so that Trainer takes its DeepSpeed path as it does on GPUs. The same as the test suite's
`_accelerate_on_cpu_shim` (tests/integration/test_hf_trainer.py). Accelerate is patched when it is
imported; nothing else is touched."""
import importlib.abc
import importlib.util
import os
import sys


def _patch(state):
    original = state.PartialState._prepare_backend

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, distributed_type = original(self, cpu, sagemaker_dp, backend)
        if chosen is None and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", state.DistributedType.MULTI_CPU
        return chosen, distributed_type

    state.PartialState._prepare_backend = _prepare_backend


class _AfterAccelerateState(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "accelerate.state":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


sys.meta_path.insert(0, _AfterAccelerateState())
