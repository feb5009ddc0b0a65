"""Every number flag of every script has a range, checked in its own script before the model
loads: the range its Args annotation names (`Annotated[int, ">= 1"]`), or >= 0 without one, and
an out-of-range or non-finite value stops with one line naming the flag."""

import dataclasses
import importlib
import re
import types
import typing

import pytest

pytestmark = pytest.mark.quick  # all of this file: `pytest -m quick`

SCRIPTS = ["grpo_sd35", "nft_sd35", "awm_sd35", "crd_sd35", "dance_grpo_flux"]
# A value outside each range
OUTSIDE = {">= 0": -1, ">= 1": 0, ">= 2": 1, "> 0": 0, "in [0, 1)": 1, "in (0, 1]": 0,
           "in [0, 1]": 1.5}


def number_fields(module) -> dict[str, type]:
    """{name: int or float} of the Args fields that hold numbers (alone, optional, or in a
    tuple); bools and Literal choices are tyro's to check."""
    hints = typing.get_type_hints(module.Args)
    numbers = {}
    for field in dataclasses.fields(module.Args):
        kinds = [hints[field.name]]
        while kinds and typing.get_origin(kinds[0]) in (typing.Union, types.UnionType, tuple):
            kinds = [kind for kind in typing.get_args(kinds[0]) if kind not in (type(None), ...)]
        if kinds and all(kind in (int, float) for kind in kinds):
            numbers[field.name] = float if float in kinds else int
    return numbers


def ranges(module) -> dict[str, str]:
    """{name: range} of every number flag: its annotation's, or ">= 0"."""
    hints = typing.get_type_hints(module.Args, include_extras=True)
    return {name: getattr(hints[name], "__metadata__", (">= 0",))[0]
            for name in number_fields(module)}


def with_value(module, name: str, value):
    """The default Args with one field set to value (in every place of a tuple)."""
    args = module.Args()
    current = getattr(args, name)
    setattr(args, name, tuple([value] * len(current)) if isinstance(current, tuple) else value)
    return args


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_number_flag_has_a_range(script):
    module = importlib.import_module(script)
    hints = typing.get_type_hints(module.Args, include_extras=True)
    annotated = {name for name, hint in hints.items() if hasattr(hint, "__metadata__")}
    stray = sorted(annotated - set(number_fields(module)))
    assert not stray, f"{script}: ranges on flags that hold no number: {stray}"
    assert set(ranges(module).values()) <= set(OUTSIDE)  # check_ranges knows each (below)


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_out_of_range_value_stops_with_one_line_naming_the_flag(script):
    module = importlib.import_module(script)
    limits = ranges(module)
    module.check_ranges(module.Args())  # the defaults are in range
    for name, kind in number_fields(module).items():
        flag = "--" + name.replace("_", "-")
        value = kind(OUTSIDE[limits[name]])
        message = re.escape(f"error: {flag} must be {limits[name]}, got")
        with pytest.raises(SystemExit, match=message):
            module.check_ranges(with_value(module, name, value))
        if kind is float:
            with pytest.raises(SystemExit, match=f"^error: {flag} must be a finite number"):
                module.check_ranges(with_value(module, name, float("nan")))


def test_tf32_defaults_to_each_upstreams_setting():
    """TF32 matmuls as each upstream runs them (read in their trees): the configs of flow_grpo
    (config/base.py), DiffusionNFT (config/base.py) and AWM (config/base_awm.py) set
    `allow_tf32 = True`, which their train scripts apply; DanceGRPO's launch script
    (scripts/finetune/finetune_flux_grpo.sh) passes `--allow_tf32`; Flow-Factory (CRD's) never
    sets it: PyTorch's default, off."""
    upstream = {"grpo_sd35": True, "nft_sd35": True, "awm_sd35": True, "crd_sd35": False,
                "dance_grpo_flux": True}
    for script, on in upstream.items():
        assert importlib.import_module(script).Args().allow_tf32 is on, script
