"""A rank's part of the model, made after construction: the single-process model's values,
and no more memory than the rank's share; the model itself knows nothing of processes."""

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import moe_train.model
from moe_parallel import is_expert_parameter
from moe_plan.config import config_from_dict
from moe_plan.config.stage_plan import plan_stages
from moe_train.model import WHOLE_SEQUENCES, Router, Transformer, causal_attention
from moe_train.model.attention import Attention
from moe_train.parallelize import ContextShard, apply_context_parallel, apply_pipeline_split
from moe_train.train.rank_build import build_rank_model
from training import small_config_data

NUM_EXPERTS = 16

MODEL_FOLDER = Path(moe_train.model.__file__).parent
PROCESS_GROUP_WORDS = re.compile(
    r"torch\.distributed|all_reduce|ProcessGroup|process_group"
    r"|^\s*(from|import)\s+moe_train\.parallelize",
    re.MULTILINE,
)
"""What a model file may not mention: process groups, collectives, or the parallel room."""


def process_group_mentions(folder: Path) -> list[str]:
    """`file:line: text` of each line of the Python files under `folder` that names them."""
    return [
        f"{path.relative_to(folder)}:{text[: match.start()].count(chr(10)) + 1}: {match[0]}"
        for path in sorted(folder.rglob("*.py"))
        for text in [path.read_text()]
        for match in PROCESS_GROUP_WORDS.finditer(text)
    ]


def test_no_model_file_names_process_groups():
    """The model is built from its config alone; parallelism is applied to it afterwards by
    `moe_train.parallelize`, so no file of the model imports torch.distributed."""
    assert process_group_mentions(MODEL_FOLDER) == []


def test_the_scan_finds_a_planted_import(tmp_path):
    """The scan above would see a model file importing torch.distributed or the room."""
    planted = tmp_path / "model"
    planted.mkdir()
    (planted / "clean.py").write_text('"""Nothing here."""\n')
    (planted / "leaky.py").write_text(
        "import torch\nimport torch.distributed as dist\nfrom moe_train.parallelize import x\n"
    )
    assert process_group_mentions(planted) == [
        "leaky.py:2: torch.distributed",
        "leaky.py:3: from moe_train.parallelize",
    ]


def test_context_parallelism_fills_the_models_hooks(tmp_path):
    """A built model attends and balances over whole sequences; `apply_context_parallel`
    gives its attention, routers and itself the shard's core and sequence part."""
    model = Transformer(_config(tmp_path).model)
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    routers = [m for m in model.modules() if isinstance(m, Router)]
    assert model.sequence is WHOLE_SEQUENCES
    assert all(a.core is causal_attention for a in attentions)
    assert all(r.sequence is WHOLE_SEQUENCES for r in routers)
    shard = ContextShard(2, 1)
    apply_context_parallel(model, shard)
    assert model.sequence is shard
    assert all(a.core == shard.attend for a in attentions)
    assert all(r.sequence is shard for r in routers)


@dataclass
class ShardOnly:
    """A dispatcher's expert range at expert-parallel rank `rank` of `ep`: all that building
    a rank's model asks of it."""

    num_experts: int
    rank: int
    ep: int

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep

    @property
    def first_local_expert(self) -> int:
        return self.rank * self.num_local_experts


def _config(tmp_path, n_layers: int = 4):
    model = {"n_layers": n_layers, "dense_layers": 1, "dense_hidden": 48}
    moe = {"num_experts": NUM_EXPERTS, "top_k": 2, "expert_hidden": 64}
    data = small_config_data(tmp_path, tmp_path / "unused.npy", train={"seed": 7})
    data["model"].update(model)
    data["model"]["moe"].update(moe)
    return config_from_dict(data)


def _rank_model(config, rank: int, ep: int, pp: int = 1, pp_rank: int = 0) -> Transformer:
    plan = plan_stages(config.model.n_layers, pp, pp_rank) if pp > 1 else None
    return build_rank_model(
        config,
        lambda layer: ShardOnly(NUM_EXPERTS, rank, ep),
        plan,
        torch.device("cpu"),
    )


@pytest.mark.parametrize(("ep", "pp"), [(4, 1), (2, 2)])
def test_every_rank_holds_exactly_the_single_process_values(tmp_path, ep, pp):
    config = _config(tmp_path)
    single = Transformer(config.model, seed=config.train.seed)
    whole = dict(single.named_parameters())
    seen: dict[str, list[int]] = {name: [] for name in whole}
    for pp_rank in range(pp):
        for rank in range(ep):
            part = _rank_model(config, rank, ep, pp, pp_rank)
            for name, param in part.named_parameters():
                assert not param.is_meta, name
                want = whole[name]
                if is_expert_parameter(param):
                    first = rank * NUM_EXPERTS // ep
                    want = want[first : first + param.shape[0]]
                    seen[name].append(first)
                else:
                    seen[name].append(-1)
                torch.testing.assert_close(param, want, rtol=0, atol=0, msg=name)
            for name, buffer in part.named_buffers():
                torch.testing.assert_close(buffer, single.get_buffer(name), msg=name)
    # Every tensor is held somewhere: each expert block once per pipeline part that has it.
    assert all(seen.values()), [name for name, ranks in seen.items() if not ranks]


def test_pipeline_split_keeps_global_names_and_its_ends(tmp_path):
    config = _config(tmp_path)
    model = Transformer(config.model)
    apply_pipeline_split(model, [2, 3], first=False, last=True)
    assert list(model.blocks) == ["2", "3"]
    assert model.embed is None and model.head is not None
    with pytest.raises(ValueError, match=r"layers \[7\] are not among"):
        apply_pipeline_split(model, [3, 7], first=False, last=True)


class AllocatedBytes(TorchDispatchMode):
    """Counts the bytes of every new (non-meta) storage an operation returns: an upper bound
    of the peak memory of what runs under it."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs or {}))[0]
            if isinstance(t, Tensor) and not t.is_meta
        }
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and not t.is_meta and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs:
                    inputs.add(storage.data_ptr())
                    self.total += storage.nbytes()
        return out


def _construction_bytes(config, rank: int, ep: int) -> int:
    with AllocatedBytes() as counter:
        _rank_model(config, rank, ep)
    return counter.total


def test_a_rank_at_ep4_allocates_a_quarter_of_the_expert_bytes(tmp_path):
    config = _config(tmp_path)
    whole = Transformer(config.model)
    expert_bytes = sum(
        p.numel() * p.element_size() for p in whole.parameters() if is_expert_parameter(p)
    )
    single = _construction_bytes(config, 0, 1)
    assert expert_bytes > 0.8 * single  # experts dominate, so a leak of them shows
    for rank in range(4):
        share = _construction_bytes(config, rank, 4)
        saved = single - share
        # Everything but three quarters of the experts, give or take 5% of the experts.
        assert saved == pytest.approx(0.75 * expert_bytes, abs=0.05 * expert_bytes), (
            f"rank {rank} at ep=4 allocated {share} bytes building its model; the whole model "
            f"takes {single}, of which {expert_bytes} are experts"
        )
