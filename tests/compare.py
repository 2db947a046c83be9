"""How far a result is from its reference: the comparisons the tests share (a rank's check
imports this by name, as the test modules do)."""
import torch


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (0 for two zero tensors)."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def relative_state(got: dict, want: dict, keys=None) -> float:
    """The same over the tensors of `want` (or of `keys`) taken together: one number for a
    whole model's state dict."""
    keys = list(want) if keys is None else list(keys)
    diff = torch.cat([(got[k].double() - want[k].double()).flatten() for k in keys]).norm()
    scale = torch.cat([want[k].double().flatten() for k in keys]).norm()
    return (diff / scale.clamp(min=1e-30)).item()
