"""The tiny-checkpoint maker never writes a drafter its own loader refuses (issue 29, item 3).

``spiffy tiny dflash DIR --target T --set num_layers=D`` used to derive the SPEC §3 default layer ids
(``round(1 + i * (T - 4) / (D - 1))``), which reach below layer 0 on a target of fewer than 3 layers
(``[1, -1]`` for T = D = 2): the library then refused the drafter. Across target depths and drafter depths, what
the maker writes (through the CLI) now loads, passes the compatibility check against its target and drafts;
layer ids given by hand outside the target are refused before anything is written.
"""

from __future__ import annotations

import pytest
import torch

from spiffy.arspec import ddtree_generate
from spiffy.cli.main import main
from spiffy.errors import ConfigError
from spiffy.models import check_compatible, load_drafter, load_target, make_tiny_dflash
from spiffy.models.ar_checkpoints import tiny_target_layer_ids
from spiffy.models.dflash import default_target_layer_ids

TARGET_DEPTHS = (1, 2, 3, 5)
DRAFTER_DEPTHS = (1, 2, 4)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_targets")
    out = {}
    for depth in TARGET_DEPTHS:
        assert main(["tiny", "qwen3", str(root / f"t{depth}"), "--set", f"num_hidden_layers={depth}"]) == 0
        out[depth] = root / f"t{depth}"
    return out


@pytest.mark.parametrize("drafter_depth", DRAFTER_DEPTHS)
@pytest.mark.parametrize("target_depth", TARGET_DEPTHS)
def test_what_the_maker_writes_loads_and_drafts(targets, tmp_path, target_depth: int, drafter_depth: int) -> None:
    out = tmp_path / "drafter"
    args = ["tiny", "dflash", str(out), "--target", str(targets[target_depth]), "--set", f"num_layers={drafter_depth}"]
    assert main(args) == 0
    target = load_target(targets[target_depth], torch.float32, "cpu")
    drafter = load_drafter(out, dtype=torch.float32)
    check_compatible(drafter, target)  # the library's own refusal, which [1, -1] used to trigger
    assert drafter.target_layer_ids == tiny_target_layer_ids(target_depth, drafter_depth)
    assert all(0 <= i < target_depth for i in drafter.target_layer_ids)
    res = ddtree_generate(target, drafter, [5, 9, 17], budget=4, max_new_tokens=3)
    assert len(res.tokens) == 3


def test_tiny_ids_follow_the_spec_default_where_it_is_valid() -> None:
    """Real depths keep the official default (Qwen3-8B: 36 target layers, 5 drafter layers)."""
    assert tiny_target_layer_ids(36, 5) == default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert tiny_target_layer_ids(2, 2) == [0, 1]  # the default would be [1, -1]
    assert tiny_target_layer_ids(1, 3) == [0, 0, 0]


def test_hand_given_ids_outside_the_target_are_refused_up_front(targets, tmp_path) -> None:
    out = tmp_path / "bad"
    with pytest.raises(ConfigError, match=r"2-layer target.*fix"):
        make_tiny_dflash(out, targets[2], num_layers=2, target_layer_ids=[1, 2])
    assert not out.exists()
