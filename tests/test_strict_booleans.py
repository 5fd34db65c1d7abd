"""Every boolean option of particles, meanfield and studies takes True or False only.

A truthy string ("yes", and "False" too) or a number is a TypeError naming the argument, through the one
shared check ``particles.validation.check_bool``; a numpy boolean is accepted as the bool it is, and the
two values still do different things (so the check does not swallow the option)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from particles import Measure
from particles.validation import check_bool

A = np.array([[0.5, 0.1, 0.0], [0.0, 0.4, 0.2], [0.1, 0.0, 0.3]])
V = np.eye(3)
X = np.random.default_rng(0).standard_normal((4, 3))


def _att():
    from meanfield import SelfAttention

    return SelfAttention(A, V)


def _options():
    """(name of the argument, call taking the value)."""
    from meanfield import IsotropicAttention, L2SelfAttention, SelfAttention, adversarial, bounds, worst_case
    from meanfield.adapters import CallableOperator, as_operator
    from studies.context import RunContext

    return [
        ("normalize", lambda v: Measure(X, normalize=v)),
        ("positions", lambda v: Measure.sphere(4, 3, positions=v)),
        ("positions", lambda v: Measure.ball(4, 3, positions=v)),
        ("positions", lambda v: Measure.gaussian(4, np.zeros(3), positions=v)),
        ("masked", lambda v: IsotropicAttention(1.0, masked=v)),
        ("masked", lambda v: SelfAttention(A, V, masked=v)),
        ("masked", lambda v: SelfAttention.from_qkv(A, A, V, masked=v)),
        ("masked", lambda v: L2SelfAttention(A, V, masked=v)),
        ("masked", lambda v: CallableOperator(lambda Y: Y, masked=v)),
        ("masked", lambda v: as_operator(lambda Y: Y, masked=v)),
        ("return_info", lambda v: adversarial.sqrt_n_sequence(A, 1.0, 4, return_info=v)),
        ("positions", lambda v: adversarial.two_dirac(A, 1.0, positions=v)),
        ("masked", lambda v: adversarial.large_radius_configuration(A, n=4, masked=v)),
        ("log", lambda v: bounds.mean_field_upper(A, V, 1.0, log=v)),
        ("log", lambda v: bounds.two_dirac_lower(A, 1.0, log=v)),
        ("masked", lambda v: bounds.argmax_indices(A, X, masked=v)),
        ("masked", lambda v: bounds.score_gap(A, X, masked=v)),
        ("structured", lambda v: worst_case.sequence_starts(_att(), 1.0, 3, structured=v)),
        ("structured", lambda v: worst_case.measure_starts(_att(), 1.0, 3, structured=v)),
        ("progress", lambda v: RunContext("/tmp/unused-run", progress=v)),
    ]


@pytest.mark.parametrize("k", range(20))
@pytest.mark.parametrize("bad", ["yes", "False", 1, 0.0, None])
def test_truthy_values_are_refused_naming_the_argument(k, bad):
    name, call = _options()[k]
    if bad is None and k == 9:
        call(None)   # as_operator's masked takes None: the callable's own
        return
    with pytest.raises(TypeError, match=rf"^{name}: expected (None, )?True or False, got"):
        call(bad)


def test_the_option_count_is_the_parametrization():
    assert len(_options()) == 20


@pytest.mark.parametrize("k", range(20))
def test_true_false_and_numpy_booleans_are_accepted(k):
    _, call = _options()[k]
    for v in (True, False, np.bool_(True), np.bool_(False)):
        call(v)


def test_numpy_bool_means_its_value():
    assert Measure.sphere(4, 3, positions=np.bool_(True)).masked
    assert not Measure.sphere(4, 3, positions=np.bool_(False)).masked
    assert check_bool(np.bool_(True), "x") is True and check_bool(None, "x", allow_none=True) is None
    with pytest.raises(TypeError, match="x: expected None, True or False, got str 'no'"):
        check_bool("no", "x", allow_none=True)


def test_worst_case_sequence_structured_yes_is_refused():
    from meanfield import SearchOptions, worst_case_sequence

    with pytest.raises(TypeError, match="structured: expected True or False, got str 'yes'"):
        worst_case_sequence(_att(), 1.0, 3, options=SearchOptions(structured="yes"), budget=50)
    with pytest.raises(TypeError, match="split: expected True or False"):
        from meanfield import worst_case_measure

        worst_case_measure(_att(), 1.0, 3, split="no", budget=50)


def test_hugging_face_and_sweep_options(tmp_path):
    pytest.importorskip("transformers")
    from meanfield import hf
    from studies import models
    from studies.sweep import run_sweep

    m = models.random_model("gpt2", size="tiny")
    for name, call in [("masked", lambda v: hf.HFAttention.from_model(m, 0, masked=v)),
                       ("block", lambda v: hf.HFAttention.from_model(m, 0, block=v)),
                       ("masked", lambda v: hf.extract_layer(m, 0).to_meanfield(masked=v)),
                       ("with_mask", lambda v: hf.capture_attention_inputs(m, torch.tensor([[1, 2]]), with_mask=v)),
                       ("is_decoder", lambda v: models.random_model("bert", size="tiny", is_decoder=v)),
                       ("allow_pickle", lambda v: models.load_model(tmp_path, allow_pickle=v)),
                       ("local_files_only", lambda v: models.load_model("owner/name", local_files_only=v)),
                       ("local_files_only", lambda v: models.load_tokenizer(tmp_path, local_files_only=v))]:
        with pytest.raises(TypeError, match=rf"^{name}: expected (None, )?True or False, got str 'yes'"):
            call("yes")
    for opt in ("resume", "progress", "overwrite"):
        with pytest.raises(TypeError, match=rf"^{opt}: expected True or False, got str 'no'"):
            run_sweep(_square, {"x": [1]}, tmp_path / opt, backend="inprocess", **{opt: "no"})


def _square(x):
    return {"y": x * x}
