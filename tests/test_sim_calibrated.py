"""Calibration: NNLS, recovering known coefficients and cost tables from synthetic steps, save/load."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from engine.sim.calibrated import CalibratedStepModel, CostTable
from engine.sim.step_batch import StepBatch
from workloads.calibration import auto_knots, fit_step_model, nnls, segment_basis, table_from_slopes

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
    model = fit_step_model(_synthetic_steps())
    assert model.intercept == pytest.approx(INTERCEPT, rel=1e-6)
    for name, c in TRUE.items():
        assert model.coefs[name] == pytest.approx(c, rel=1e-6)
    assert model.r2 == pytest.approx(1.0)


def test_fit_with_noise_the_kv_tokens_column_and_no_speculation() -> None:
    df = _synthetic_steps(noise=2e-4, kv_column="num_kv_tokens_read")
    df["step_time"] += TRUE["num_decode_reqs"] * (df["num_decode_tokens"] - df["num_decode_reqs"])
    df["num_decode_reqs"] = df["num_decode_tokens"]  # one token per decode request
    model = fit_step_model(df)
    assert set(model.coefs) == {"num_prefill_tokens", "num_decode_tokens", "num_kv_tokens_read"}
    assert model.coefs["num_decode_tokens"] == pytest.approx(6e-4, rel=0.05)
    assert 0.95 < model.r2 < 1.0
    assert all(c >= 0 for c in model.coefs.values()) and model.intercept >= 0


def test_idle_rows_dropped_and_missing_columns_reported() -> None:
    df = _synthetic_steps(50)
    idle = df.iloc[:5].assign(num_prefill_tokens=0, num_decode_tokens=0, step_time=9.0)
    model = fit_step_model(pd.concat([df, idle]))
    assert model.num_samples == (df["num_prefill_tokens"] + df["num_decode_tokens"] > 0).sum()
    with pytest.raises(ValueError, match="lacks"):
        fit_step_model(df.drop(columns=["num_decode_reqs"]))


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
    model = fit_step_model(_synthetic_steps(60))
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


# ---- cost tables (piecewise-linear, interpolated) -------------------------------------------


def test_cost_table_interpolates_and_extrapolates_by_hand() -> None:
    # Through (0, 0), (1, 50 ms), (4, 110 ms); 15 ms per unit after 4.
    table = CostTable((1.0, 4.0), (0.050, 0.110), slope_after=0.015)
    assert table(0) == 0.0 and table(1) == pytest.approx(0.050)
    assert table(0.5) == pytest.approx(0.025)
    assert table(2) == pytest.approx(0.050 + 0.060 / 3)  # a third of the way from 1 to 4
    assert table(4) == pytest.approx(0.110) and table(10) == pytest.approx(0.110 + 6 * 0.015)
    # The same table from segment slopes: 50 ms/unit on (0, 1], 20 ms/unit on (1, 4], then 15.
    assert table_from_slopes([1, 4], [0.050, 0.020, 0.015]) == table
    np.testing.assert_allclose(segment_basis(np.array([0.5, 3.0, 10.0]), [1, 4]),
                               [[0.5, 0, 0], [1, 2, 0], [1, 3, 6]])  # fmt: skip
    with pytest.raises(ValueError, match="increasing"):
        CostTable((4.0, 1.0), (0.1, 0.2))


def test_auto_knots_need_rows_on_both_sides() -> None:
    x = np.array([1] * 10 + [2] * 10 + [3] * 2 + [4] * 10 + [10] * 6)
    # 3 has too few rows in (2, 3]; 6 and 8 too few rows in (4, 6] / (4, 8]; 10 is the maximum.
    assert auto_knots(x) == [1, 2, 4]
    assert auto_knots(np.array([1, 1, 1])) == []


def _stepwise_decode_steps(n: int = 600) -> tuple[pd.DataFrame, CostTable]:
    """CPU-like steps: decode cost jumps with the batch size, a mixed step costs extra."""
    rng = np.random.default_rng(1)
    table = CostTable((1.0, 3.0, 4.0, 8.0), (0.010, 0.025, 0.050, 0.090), slope_after=0.010)
    decode = rng.integers(0, 13, n)
    prefill = rng.integers(0, 300, n) * (rng.random(n) < 0.4)
    decode[(decode == 0) & (prefill == 0)] = 1
    df = pd.DataFrame({
        "num_prefill_tokens": prefill, "num_decode_tokens": decode, "num_decode_reqs": decode,
        "num_prefill_reqs": (prefill > 0).astype(int), "num_kv_tokens_read": rng.integers(0, 4000, n),
    })  # fmt: skip
    mixed = ((prefill > 0) & (decode > 0)).astype(float)
    df["step_time"] = (0.040 + 1e-3 * prefill + 2e-6 * df["num_kv_tokens_read"] + 0.025 * mixed
                       + np.array([table(d) for d in decode]))  # fmt: skip
    return df, table


def test_table_fit_recovers_a_stepwise_decode_cost() -> None:
    df, true = _stepwise_decode_steps()
    model = fit_step_model(
        df, features=["num_prefill_tokens", "is_mixed", "num_kv_tokens_read"],
        tables={"num_decode_reqs": [1, 3, 4, 8]},
    )  # fmt: skip
    assert model.intercept == pytest.approx(0.040, rel=1e-6)
    assert model.coefs["num_prefill_tokens"] == pytest.approx(1e-3, rel=1e-6)
    assert model.coefs["is_mixed"] == pytest.approx(0.025, rel=1e-6)  # derived from the csv columns
    fitted = model.tables["num_decode_reqs"]
    np.testing.assert_allclose(fitted.ys, true.ys, rtol=1e-6)
    assert fitted.slope_after == pytest.approx(true.slope_after, rel=1e-6)
    assert model.r2 == pytest.approx(1.0)
    # A linear fit cannot follow the jumps.
    assert fit_step_model(df).r2 < 0.999
    # Predicting from a StepBatch: 2 decodes of contexts 40 and 7 plus a 100-token prompt chunk.
    batch = StepBatch.from_requests([(100, 0, True, False), (1, 40, True, True), (1, 7, True, True)])
    expected = 0.040 + 0.100 + 47 * 2e-6 + 0.025 + true(2)
    assert model.step_time(batch) == pytest.approx(expected, rel=1e-6)
    assert sum(model.breakdown(batch).values()) == pytest.approx(expected, rel=1e-6)
    assert model.breakdown(batch)["table:num_decode_reqs"] == pytest.approx(true(2), rel=1e-6)


def test_automatic_knots_and_robust_fit_ignore_outlier_steps() -> None:
    df, true = _stepwise_decode_steps()
    slow = df.index[::50]
    df.loc[slow, "step_time"] += 0.5  # 2% of the steps stalled by something else
    features = ["num_prefill_tokens", "is_mixed", "num_kv_tokens_read"]
    robust = fit_step_model(df, features=features, tables={"num_decode_reqs": []}, robust=True)
    plain = fit_step_model(df, features=features, tables={"num_decode_reqs": []})
    table = robust.tables["num_decode_reqs"]
    assert set(true.xs) <= set(table.xs) and max(table.xs) < 12
    clean = df.drop(index=slow)
    err = {name: np.abs([m.step_time(_batch_of(r)) - r.step_time for r in clean.itertuples()]).max()
           for name, m in (("robust", robust), ("plain", plain))}  # fmt: skip
    assert err["robust"] < 2e-3 < err["plain"]


def _batch_of(row) -> StepBatch:  # type: ignore[no-untyped-def]
    """A StepBatch with a steps.csv row's aggregates (the features the models here read)."""
    return StepBatch(num_tokens=row.num_prefill_tokens + row.num_decode_tokens, num_prefill_tokens=row.num_prefill_tokens,
                     num_decode_tokens=row.num_decode_tokens, num_decode_reqs=row.num_decode_reqs,
                     num_reqs=row.num_decode_reqs + row.num_prefill_reqs, kv_tokens_read=row.num_kv_tokens_read)  # fmt: skip


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_table_model_roundtrip_and_old_files_load(tmp_path, suffix: str) -> None:
    df, _ = _stepwise_decode_steps(200)
    model = fit_step_model(df, features=["num_prefill_tokens"], tables={"num_decode_reqs": [1, 4]})
    path = tmp_path / f"fit{suffix}"
    model.save(path)
    loaded = CalibratedStepModel.load(path)
    assert loaded.tables == model.tables and loaded.coefs == model.coefs
    batch = StepBatch.from_requests([(1, 5, True, True)] * 6)
    assert loaded.step_time(batch) == pytest.approx(model.step_time(batch))
    # A file saved before tables existed (no "tables" key) loads as the plain linear model.
    old = {"kind": "calibrated", "intercept": 0.05, "coefs": {"num_decode_tokens": 0.01}, "r2": 0.9,
           "num_samples": 10, "meta": {}}  # fmt: skip
    (tmp_path / "old.json").write_text(json.dumps(old))
    legacy = CalibratedStepModel.load(tmp_path / "old.json")
    assert legacy.tables == {} and legacy.step_time(batch) == pytest.approx(0.05 + 6 * 0.01)
    assert "tables" not in legacy.to_dict()


def test_non_monotone_table_follows_a_faster_kernel_at_larger_sizes() -> None:
    # Cost per token count: +30 ms per token up to 4, then a faster path: down 40 ms by 8, +5 ms/token after.
    true = CostTable((4.0, 8.0), (0.120, 0.080), slope_after=0.005)
    n = np.arange(1, 13).repeat(10)
    df = pd.DataFrame({"num_prefill_tokens": 0 * n, "num_decode_tokens": n, "num_decode_reqs": n})
    df["step_time"] = 0.050 + np.array([true(x) for x in n])
    free = fit_step_model(df, features=[], tables={"num_tokens": [4, 8]}, monotone=False)
    np.testing.assert_allclose(free.tables["num_tokens"].ys, true.ys, rtol=1e-6)
    assert free.tables["num_tokens"].slope_after == pytest.approx(0.005, rel=1e-6)
    assert free.intercept == pytest.approx(0.050, rel=1e-6) and free.r2 == pytest.approx(1.0)
    # Monotone (the default), the table cannot fall: it stays flat after the peak instead.
    mono = fit_step_model(df, features=[], tables={"num_tokens": [4, 8]})
    ys = mono.tables["num_tokens"].ys
    assert ys[1] >= ys[0] and mono.r2 < 0.99
    # Beyond the last knot a table never falls, even where the data does (no negative extrapolation).
    tail = fit_step_model(df, features=[], tables={"num_tokens": [4]}, monotone=False)
    assert tail.tables["num_tokens"].slope_after == 0.0
