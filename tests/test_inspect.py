"""``impasto inspect objective``: per-timestep schedule, sampling probability and loss weight."""

from __future__ import annotations

import json

import pytest
import yaml
from PIL import Image

from impasto.cli import main


def _inspect(tiny_raw, tmp_path, capsys, objective, *extra):
    tiny_raw["objective"] = objective
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_raw))
    code = main(["inspect", "objective", str(path), *extra])
    return code, capsys.readouterr()


def test_json_rows_for_sdxl_with_min_snr_v(tiny_raw, tmp_path, capsys):
    objective = {"prediction_type": "v_prediction", "loss_weighting": "min_snr"}
    code, out = _inspect(tiny_raw, tmp_path, capsys, objective, "--json")
    rows = json.loads(out.out)
    assert code == 0 and len(rows) == 1000
    assert set(rows[0]) == {"t", "sigma", "snr", "prob", "weight"}
    assert [round(rows[t]["sigma"], 4) for t in (0, 999)] == [0.0292, 14.6146]  # SDXL
    assert sum(row["prob"] for row in rows) == pytest.approx(1.0)
    for row in rows[::97]:
        snr = row["snr"]
        assert row["snr"] == pytest.approx(1 / row["sigma"] ** 2)
        assert row["weight"] == pytest.approx(min(snr, 5.0) / (snr + 1))


def test_table_bias_and_plot(tiny_raw, tmp_path, capsys):
    objective = {
        "timestep_sampling": "timestep_bias",
        "timestep_bias": {"strategy": "range", "begin": 200, "end": 300, "multiplier": 3.0},
    }
    plot = tmp_path / "objective.png"
    code, out = _inspect(tiny_raw, tmp_path, capsys, objective, "--plot", str(plot))
    lines = out.out.splitlines()
    assert code == 0 and lines[0].split() == ["t", "sigma", "snr", "prob", "weight"]
    assert len(lines) == 1001
    probs = [float(line.split()[3]) for line in lines[1:]]
    assert probs[250] == pytest.approx(3 * probs[100]) and probs[300] == probs[100]
    assert probs[100] == pytest.approx(1 / (900 + 3 * 100), rel=1e-5)
    with Image.open(plot) as image:
        assert image.size == (720, 4 * 180 + 40)


def test_bad_objective_is_one_line(tiny_raw, tmp_path, capsys):
    code, out = _inspect(tiny_raw, tmp_path, capsys, {"zero_terminal_snr": True})
    assert code == 2 and out.err.count("\n") == 1
    assert "zero_terminal_snr needs prediction_type: v_prediction" in out.err


def test_flow_rows_on_a_grid_of_t(tiny_raw, tmp_path, capsys):
    objective = {
        "prediction_type": "flow",
        "timestep_sampling": "logit_normal",
        "flow_shift": 3.0,
        "loss_weighting": "sigma_sqrt",
    }
    code, out = _inspect(tiny_raw, tmp_path, capsys, objective, "--json")
    rows = json.loads(out.out)
    assert code == 0 and len(rows) == 1000
    assert [rows[0]["t"], rows[-1]["t"]] == [0.0005, 0.9995]  # midpoints of (0, 1)
    assert sum(row["prob"] for row in rows) / 1000 == pytest.approx(1.0, abs=1e-3)
    for row in rows[::111]:
        t = row["t"]
        assert row["sigma"] == pytest.approx(t / (1 - t))
        assert row["snr"] == pytest.approx(((1 - t) / t) ** 2)
        assert row["weight"] == pytest.approx(t**-2, rel=1e-6)
    # Shift 3 moves the logit-normal's median from t = ½ to 3·½/(1 + 2·½) = 0.75.
    cumulative = 0.0
    for row in rows:
        cumulative += row["prob"] / 1000
        if cumulative >= 0.5:
            break
    assert row["t"] == pytest.approx(0.75, abs=2e-3)
