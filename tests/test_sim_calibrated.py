"""Calibration: NNLS, recovering known coefficients from synthetic steps, save/load."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from engine.sim.calibrated import CalibratedStepModel, nnls
from engine.sim.step_batch import StepBatch

TRUE = {
    "num_prefill_tokens": 2e-4,
    "num_decode_tokens": 5e-4,
    "num_decode_reqs": 1e-4,
    "kv_blocks_used": 3e-6,
}
INTERCEPT = 4e-3


def _synthetic_steps(n: int = 400, noise: float = 0.0, kv_column: str = "kv_blocks_used") -> pd.DataFrame:
    rng = np.random.default_rng(0)
    decode_reqs = rng.integers(0, 64, n)
    # Speculative decoding proposes 0-3 extra tokens per request, so tokens != requests.
    decode_tokens = decode_reqs * (1 + rng.integers(0, 4, n))
    df = pd.DataFrame(
        {
            "num_prefill_tokens": rng.integers(0, 2048, n) * (rng.random(n) < 0.5),
            "num_decode_tokens": decode_tokens,
            "num_decode_reqs": decode_reqs,
            kv_column: rng.integers(0, 5000, n),
        }
    )
    coefs = {k: c for k, c in TRUE.items() if k != "kv_blocks_used"} | {kv_column: TRUE["kv_blocks_used"]}
    df["step_time"] = INTERCEPT + sum(c * df[k] for k, c in coefs.items()) + noise * rng.standard_normal(n)
    return df


def test_nnls_matches_unconstrained_when_positive_and_clips_otherwise() -> None:
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    np.testing.assert_allclose(nnls(a, a @ np.array([2.0, 3.0])), [2.0, 3.0], atol=1e-12)
    # Unconstrained solution has x1 < 0: NNLS sets it to 0 and refits x0.
    b = np.array([1.0, -2.0, -1.0])
    x = nnls(a, b)
    assert x[1] == 0.0
    assert x[0] == pytest.approx(np.linalg.lstsq(a[:, :1], b, rcond=None)[0][0])


def test_fit_recovers_known_coefficients() -> None:
    model = CalibratedStepModel.fit(_synthetic_steps())
    assert model.intercept == pytest.approx(INTERCEPT, rel=1e-6)
    for name, c in TRUE.items():
        assert model.coefs[name] == pytest.approx(c, rel=1e-6)
    assert model.r2 == pytest.approx(1.0)


def test_fit_with_noise_the_kv_tokens_column_and_no_speculation() -> None:
    df = _synthetic_steps(noise=2e-4, kv_column="num_kv_tokens_read")
    df["step_time"] += TRUE["num_decode_reqs"] * (df["num_decode_tokens"] - df["num_decode_reqs"])
    df["num_decode_reqs"] = df["num_decode_tokens"]  # one token per decode request
    model = CalibratedStepModel.fit(df)
    assert set(model.coefs) == {"num_prefill_tokens", "num_decode_tokens", "num_kv_tokens_read"}
    assert model.coefs["num_decode_tokens"] == pytest.approx(6e-4, rel=0.05)
    assert 0.95 < model.r2 < 1.0
    assert all(c >= 0 for c in model.coefs.values()) and model.intercept >= 0


def test_idle_rows_dropped_and_missing_columns_reported() -> None:
    df = _synthetic_steps(50)
    idle = df.iloc[:5].assign(num_prefill_tokens=0, num_decode_tokens=0, step_time=9.0)
    model = CalibratedStepModel.fit(pd.concat([df, idle]))
    assert model.num_samples == (df["num_prefill_tokens"] + df["num_decode_tokens"] > 0).sum()
    with pytest.raises(ValueError, match="lacks"):
        CalibratedStepModel.fit(df.drop(columns=["num_decode_reqs"]))


def test_predict_from_a_batch() -> None:
    model = CalibratedStepModel(
        0.01, {"num_prefill_tokens": 1e-3, "num_decode_reqs": 2e-3, "kv_blocks_used": 1e-5}
    )
    batch = StepBatch.from_requests(
        [(100, 0, True, False), (1, 40, True, True), (1, 7, True, True)], block_size=16
    )
    # kv blocks: ceil(100/16) + ceil(41/16) + ceil(8/16) = 7 + 3 + 1
    expected = 0.01 + 100 * 1e-3 + 2 * 2e-3 + 11 * 1e-5
    assert model.step_time(batch) == pytest.approx(expected)
    assert sum(model.breakdown(batch).values()) == pytest.approx(expected)
    assert model.step_time(StepBatch()) == 0.0


def test_prefill_requests_feature() -> None:
    # Two prompt chunks and one decode: 2 prefill requests at 5 ms each on top of the tokens.
    model = CalibratedStepModel(0.0, {"num_prefill_reqs": 5e-3, "num_prefill_tokens": 1e-4})
    batch = StepBatch.from_requests([(30, 0, False, False), (10, 20, True, False), (1, 9, True, True)])
    assert (batch.num_reqs, batch.num_prefill_reqs, batch.num_prefill_tokens) == (3, 2, 40)
    assert model.step_time(batch) == pytest.approx(2 * 5e-3 + 40 * 1e-4)


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_save_load_roundtrip(tmp_path, suffix: str) -> None:
    model = CalibratedStepModel.fit(_synthetic_steps(60))
    model.meta["run"] = "synthetic"
    path = tmp_path / f"fit{suffix}"
    model.save(path)
    loaded = CalibratedStepModel.load(path)
    assert (loaded.intercept, loaded.coefs, loaded.r2, loaded.meta) == (
        model.intercept,
        model.coefs,
        model.r2,
        model.meta,
    )


def test_unknown_feature_rejected() -> None:
    with pytest.raises(ValueError, match="unknown features"):
        CalibratedStepModel(0.0, {"gpu_temperature": 1.0})
