"""Engine options are declared once (EngineConfig's fields, nvray/options.py): each exposed one
is a Serve app argument and a batch flag with the engine's default, reaches the engine from
both, and every option's bounds and choices are refused by name on every surface."""

from __future__ import annotations

import pytest

from deployments.args import AppArgs, parse_args
from nvray.batch.__main__ import engine_kwargs_from_args
from nvray.batch.__main__ import parse_args as parse_batch_args
from nvray.config import EngineConfig, exposed_options
from nvray.options import Option, options_of

BATCH = ["--input", "in.jsonl", "--output", "out.jsonl"]
# values that need another option to hold (the rest are picked from the bounds and choices)
RELATED = {"max_cpu_loras": 8, "hf_overrides": {"rope_theta": 5000.0},
           "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}


def _another_value(opt: Option):
    """An allowed value of the option that is not its default."""
    if opt.name in RELATED:
        return RELATED[opt.name]
    if opt.choices is not None:
        return next(c for c in opt.choices if c != opt.default and c is not None)
    if opt.scalar_type is bool:
        return not opt.default
    low = opt.ge if opt.ge is not None else opt.gt if opt.gt is not None else 0
    high = opt.le if opt.le is not None else low + 64
    value = opt.scalar_type((low + high) / 2 if opt.scalar_type is float else low + 1)
    return value if value != opt.default else opt.scalar_type(high)


def _as_flag(opt: Option, value) -> list[str]:
    flag = "--" + opt.name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + opt.name.replace("_", "-")]
    if isinstance(value, dict):
        import json

        return [flag, json.dumps(value)]
    return [flag, str(value)]


@pytest.mark.parametrize("opt", exposed_options(), ids=lambda o: o.name)
def test_an_exposed_option_is_an_app_argument_and_a_batch_flag_that_reach_the_engine(opt):
    engine_default = getattr(EngineConfig(), opt.name)
    app_field = AppArgs.model_fields[opt.name]
    assert app_field.description
    if opt.name != "max_num_batched_tokens":  # the app's documented step budget
        assert app_field.default == engine_default
    assert getattr(parse_batch_args(BATCH), opt.name) == engine_default

    value = _another_value(opt)
    assert getattr(parse_args({opt.name: value}).engine_config(), opt.name) == value
    kwargs = engine_kwargs_from_args(parse_batch_args(BATCH + _as_flag(opt, value)))
    assert getattr(EngineConfig.from_kwargs(**kwargs), opt.name) == value


def _out_of_bounds(opt: Option):
    if opt.le is not None:
        return opt.le + 1
    return opt.ge - 1 if opt.ge is not None else opt.gt


BOUNDED = [o for o in options_of(EngineConfig) if o.allowed() is not None]


@pytest.mark.parametrize("opt", BOUNDED, ids=lambda o: o.name)
def test_a_value_out_of_bounds_is_refused_by_name_on_every_surface(opt):
    bad = _out_of_bounds(opt)
    with pytest.raises(ValueError, match=f"^{opt.name}={bad!r} is invalid: must be "):
        EngineConfig(**{opt.name: bad})
    surface = {opt.name: bad} if opt.exposed else {"engine_options": {opt.name: bad}}
    with pytest.raises(ValueError, match=f"invalid nvray app arguments: .*{opt.name}"):
        parse_args(surface)
    if opt.exposed:
        with pytest.raises(SystemExit):
            parse_batch_args(BATCH + _as_flag(opt, bad))


def test_the_engines_bounds_and_choices_read_as_users_see_them():
    for kwargs, message in (
            ({"max_num_seqs": 0}, "max_num_seqs=0 is invalid: must be >= 1"),
            ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5 is invalid: "
                                              r"must be in \(0, 1\]"),
            ({"max_prefill_graph_tokens": 5000}, r"must be in \[0, 4096\]"),
            ({"max_model_len": 0}, "max_model_len=0 is invalid: must be >= 1 or None"),
            ({"step_timeout_s": 0.0}, "step_timeout_s=0.0 is invalid: must be > 0"),
            ({"quantization": "int4"}, r"quantization='int4' is invalid: must be one of "
                                       r"\[None, 'fp8'\]"),
            ({"kvcache_block_size": 24}, "kvcache_block_size=24 is invalid: must be a power "
                                         "of two")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(**kwargs)


def test_any_other_option_passes_through_and_a_doubled_one_is_refused():
    config = parse_args({"engine_options": {"cpu_kvcache_space_gib": 1.5}}).engine_config()
    assert config.cpu_kvcache_space_gib == 1.5
    kwargs = engine_kwargs_from_args(parse_batch_args(
        BATCH + ["--engine-options", '{"cpu_kvcache_space_gib": 1.5}']))
    assert EngineConfig.from_kwargs(**kwargs).cpu_kvcache_space_gib == 1.5

    with pytest.raises(ValueError, match=r"engine_options \['max_num_seqs'\].*of its own"):
        parse_args({"engine_options": {"max_num_seqs": 8}})
    with pytest.raises(ValueError, match=r"--engine-options \['max_num_seqs'\].*of its own"):
        engine_kwargs_from_args(parse_batch_args(
            BATCH + ["--engine-options", '{"max_num_seqs": 8}']))
    with pytest.raises(ValueError, match=r"unknown engine option\(s\): \['bogus'\]"):
        engine_kwargs_from_args(parse_batch_args(BATCH + ["--engine-options", '{"bogus": 1}']))
