"""Stand-in for torchaudio on the CPU-only recipe runs (benchmarks/recipes/run.py puts this
folder on PYTHONPATH for the DeepSpeed run and the veScale run alike).

PyPI's torchaudio is a CUDA build (its _torchaudio.so needs libc10_cuda.so) and its newest release
pins torch 2.11, so it does not import beside torch 2.13's CPU build. LLaMA-Factory imports it at
the top of llamafactory/data/mm_plugin.py and calls it only for audio inputs, which the text SFT
runs here never have: any use is an error rather than a silent no-op."""


def _unavailable(*args, **kwargs):
    raise RuntimeError("torchaudio is a stub on this CPU-only recipe run (benchmarks/recipes)")


load = _unavailable


class functional:  # noqa: N801 (a module's name in the real package)
    resample = staticmethod(_unavailable)
