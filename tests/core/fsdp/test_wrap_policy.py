"""The default wrap policy (no `vescale.wrap_policy`): which modules become FSDP units for a
Hugging Face model, our GPT, and a model with neither; the explicit policies unchanged; and, as
rank 0 of 64 on the fake process group, the default's gathered peak next to blocks wrapped
(measured by the buffers' own accounting). Training with the default runs in test_engine.py's
rank pool (test_llama_default_wrap_policy_trains_like_one_process)."""

import re

import pytest
import torch
from torch import nn

import fsdp_models as fm
from dist_harness import engine_log_messages
from test_engine import tiny_llama
from vescale_engine import initialize
from vescale_engine.shard.dbuffer import DBuffer
from vescale_engine.fsdp import unit_of
from vescale_engine.engine.wrap import DEFAULT_UNITS, choose_units, size_threshold

FAKE_WORLD = 64


def names(model, modules):
    where = {id(m): n for n, m in model.named_modules()}
    return [where[id(m)] for m in modules]


def params(module):
    return sum(p.numel() for p in module.parameters())


# -- which rule, which modules ---------------------------------------------------------------------

def test_hugging_face_model_gets_its_declared_decoder_layers():
    model = tiny_llama()
    choice = choose_units(model)
    assert choice.rule == "the model's _no_split_modules"
    assert choice.detail == "LlamaDecoderLayer"
    assert names(model, choice.modules) == ["model.layers.0", "model.layers.1", "model.layers.2"]


def test_declaration_is_found_inside_a_user_wrapper_and_with_tied_embeddings():
    class Wrapper(nn.Module):  # a user's module around the Hugging Face one
        def __init__(self):
            super().__init__()
            self.lm = tiny_llama(tie_word_embeddings=True)
            self.value_head = nn.Linear(32, 1)

    model = Wrapper()
    assert model.lm.lm_head.weight is model.lm.model.embed_tokens.weight
    choice = choose_units(model)
    assert choice.rule == "the model's _no_split_modules"
    assert names(model, choice.modules) == [f"lm.model.layers.{i}" for i in range(3)]


def test_declared_classes_the_model_lacks_are_ignored():
    model = fm.make("gpt")
    model._no_split_modules = ["VisionLayer"]  # e.g. a multimodal list on a text-only model
    assert choose_units(model).rule == "repeated children of a ModuleList"


def test_gpt_gets_its_blocks():
    model = fm.make("gpt")
    choice = choose_units(model)
    assert choice.rule == "repeated children of a ModuleList" and choice.detail == "Block"
    assert list(choice.modules) == list(model.blocks)


def test_repeated_children_are_the_outermost_ones():
    """MoE: the layers are units, not the experts inside them."""
    model = fm.make("moe")
    choice = choose_units(model)
    assert choice.rule == "repeated children of a ModuleList" and choice.detail == "MoELayer"
    assert list(choice.modules) == list(model.layers)


def test_a_sequential_keeps_a_parameter_in_the_root():
    """fully_shard needs the root to own something: the last repeated child stays with it."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 8))
    choice = choose_units(model)
    assert choice.rule == "repeated children of a ModuleList"
    assert names(model, choice.modules) == ["0", "2"]


class Unstructured(nn.Module):
    """No declaration, no repeated children: different layers, one of them nested, an
    embedding tied to the output layer, and a small ModuleList of two heads."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(500, 64)
        self.up = nn.Linear(64, 256)
        self.conv = nn.Conv1d(256, 64, 3)
        self.mixer = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64))
        self.down = nn.Linear(64, 32)
        self.heads = nn.ModuleList(nn.Linear(32, 2) for _ in range(2))  # < half the model
        self.out = nn.Linear(64, 500, bias=False)
        self.out.weight = self.embed.weight  # tied


def test_model_with_no_structure_gets_size_units():
    model = Unstructured()
    total = params(model)  # the tied weight once
    choice = choose_units(model)
    threshold = size_threshold(total)
    assert choice.rule == "size threshold" and threshold == -(-total // DEFAULT_UNITS)
    assert choice.detail == f"~{threshold:,} parameters per unit"
    # up and conv reach the threshold; the tied embedding/output pair cannot leave the root
    # (which stays gathered through the forward), so the rest is split off it, largest
    # first, and the ModuleList (whose forward never runs) only through its children
    assert names(model, choice.modules) == ["up", "conv", "mixer", "down", "heads.0",
                                            "heads.1"]
    assert total - sum(params(m) for m in choice.modules) == params(model.embed)


def test_many_small_siblings_are_split_off_until_the_root_is_small():
    """Children each far below the threshold, directly on the root: the largest become units
    until what stays in the root is at most the threshold (not one unit of everything)."""
    model = nn.Module()
    for i in range(20):
        model.add_module(f"layer{i}", nn.Linear(16 + i, 16, bias=False))
    total = params(model)
    choice = choose_units(model)
    threshold = size_threshold(total)
    assert choice.rule == "size threshold"
    root_left = total - sum(params(m) for m in choice.modules)
    assert 0 < root_left <= threshold
    assert all(params(m) < threshold for m in choice.modules)
    assert names(model, choice.modules)[:3] == ["layer19", "layer18", "layer17"]  # largest first


def test_default_never_picks_a_module_whose_forward_does_not_run():
    """A ModuleList of ModuleLists: the inner lists repeat, but nothing calls them; their
    children (which the model calls) are the units."""
    class Grid(nn.Module):
        def __init__(self):
            super().__init__()
            self.rows = nn.ModuleList(nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
                                      for _ in range(2))
            self.out = nn.Linear(8, 2)

    model = Grid()
    choice = choose_units(model)
    assert choice.rule == "repeated children of a ModuleList"
    assert names(model, choice.modules) == [f"rows.{r}.{c}" for r in range(2) for c in range(3)]


def test_size_threshold_is_capped_for_huge_models():
    assert size_threshold(80) == 10
    assert size_threshold(8 * 10 ** 9) == 10 ** 8  # PyTorch FSDP1's size-based default
    assert size_threshold(0) == 1


def test_explicit_policies_choose_as_before():
    """wrap_policy.module_classes / min_params pick exactly what they did: the matching
    classes; the smallest subtrees with min_params not-yet-wrapped parameters, post-order."""
    model = fm.make("gpt")
    choice = choose_units(model, module_classes=("Block",))
    assert choice.rule == "vescale.wrap_policy.module_classes"
    assert list(choice.modules) == list(model.blocks)
    choice = choose_units(model, module_classes=("Block", "LayerNorm"))  # nested classes
    assert names(model, choice.modules) == [
        n for i in range(4) for n in (f"blocks.{i}.ln1", f"blocks.{i}.ln2", f"blocks.{i}")
    ] + ["ln_f"]
    choice = choose_units(model, min_params=10_000)
    assert choice.rule == "vescale.wrap_policy.min_params"
    # qkv (12,288), fc (16,640) and out (16,448) reach it; the rest of each block (4,416)
    # does not, so the four remainders add up in the ModuleList (17,664)
    assert names(model, choice.modules) == [
        n for i in range(4) for n in (f"blocks.{i}.qkv", f"blocks.{i}.fc", f"blocks.{i}.out")
    ] + ["blocks"]
    assert choose_units(model, min_params=10 ** 9).modules == ()  # the root alone
    with pytest.raises(ValueError, match=r"module_classes \['Nope'\] match no module"):
        choose_units(model, module_classes=("Nope",))


# -- as rank 0 (or 1) of 64 on the fake process group ----------------------------------------------

@pytest.fixture(params=[0, 1], ids=["rank0", "rank1"])
def fake_rank(request, monkeypatch):
    """This process as rank 0 or 1 of FAKE_WORLD ranks on PyTorch's fake process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    rank = request.param
    for name, value in (("RANK", str(rank)), ("WORLD_SIZE", str(FAKE_WORLD)),
                        ("LOCAL_RANK", str(rank))):
        monkeypatch.setenv(name, value)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=FAKE_WORLD)
    try:
        yield rank
    finally:
        dist.destroy_process_group()


CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 100,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3}}
POLICIES = {
    "empty": {"vescale": {}},                     # what a migrating DeepSpeed user writes
    "absent": {},                                 # a DeepSpeed config as it is
    "blocks": {"vescale": {"wrap_policy": {"module_classes": ["Block"]}}},
    "one_unit": {"vescale": {"wrap_policy": {"min_params": 10 ** 12}}},  # the old default
}


def gathered_peak(monkeypatch, policy):
    """Peak over one forward, backward and step of the full-size bytes all DBuffers hold,
    sampled after each full-size allocation (the only moment the total can grow), the
    units, and the engine's log lines."""
    with engine_log_messages() as messages:
        engine, *_ = initialize(model=fm.make("gpt"), config={**CONFIG, **POLICIES[policy]})
    units = [unit_of(m) for m in engine.module.modules() if unit_of(m)]
    buffers = [b for u in units for b in u.buffers]
    peak = [0]
    allocate = DBuffer._allocate

    def tracked(buf, name):
        tensor = allocate(buf, name)
        peak[0] = max(peak[0], sum(b.full_bytes_held for b in buffers))
        return tensor

    monkeypatch.setattr(DBuffer, "_allocate", tracked)
    idx, tgt = fm.batch("gpt", 0, 2)
    engine.backward(engine(idx, tgt))
    engine.step()
    monkeypatch.setattr(DBuffer, "_allocate", allocate)
    return peak[0], [type(u.module).__name__ for u in units], messages


def test_default_gathered_peak_matches_blocks_wrapped(fake_rank, monkeypatch):
    peaks, units = {}, {}
    for policy in POLICIES:
        peaks[policy], units[policy], _ = gathered_peak(monkeypatch, policy)
    assert units["empty"] == units["absent"] == units["blocks"] == ["GPT"] + ["Block"] * 4
    assert units["one_unit"] == ["GPT"]
    whole = params(fm.make("gpt")) * 4
    assert peaks["one_unit"] >= whole  # the control: every parameter gathered at once
    for policy in ("empty", "absent"):
        assert peaks[policy] <= 1.1 * peaks["blocks"], (peaks, policy)
        assert peaks["one_unit"] > 1.1 * peaks[policy], peaks


def test_the_choice_is_logged_once_on_rank_zero_only(fake_rank, monkeypatch):
    _, _, messages = gathered_peak(monkeypatch, "empty")
    wrap_lines = [m for m in messages if m.startswith("wrap policy")]
    if fake_rank:
        assert wrap_lines == []
        return
    block = params(fm.make("gpt").blocks[0])
    assert len(wrap_lines) == 1 and re.fullmatch(re.escape(
        "wrap policy: repeated children of a ModuleList (Block) -> 5 FSDP units (4 + the "
        f"root); largest Block with {block:,} parameters of {params(fm.make('gpt')):,}; "
        "padding ") + r"\d+\.\d%", wrap_lines[0]), wrap_lines
