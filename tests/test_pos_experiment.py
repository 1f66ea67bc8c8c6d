"""The POS-tagging experiment end to end with the `smoke` config (a few files, 30 steps)."""

import json

import pytest

from attnlab.data import brown
from experiments.configs import pos_tagging as pos_config


def test_config_variants():
    for v in pos_config.POS_VARIANTS + ("smoke", "learned", "gru"):
        assert pos_config.get_config(v).variant == v
    assert pos_config.get_config("window4").model.window == 4
    assert pos_config.get_config("nopos").model.posenc == "none"
    with pytest.raises(ValueError, match="unknown"):
        pos_config.get_config("nope")


@pytest.mark.slow
def test_smoke_end_to_end(tmp_path):
    try:
        brown.brown_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from experiments import pos_tagging

    cfg = pos_config.get_config("smoke")
    result = pos_tagging.run(cfg, tmp_path, verbose=False)
    run_dir = tmp_path / "smoke"
    for name in ("config.json", "metrics.jsonl", "result.json", "attention_map.json"):
        assert (run_dir / name).exists(), name
    assert 0.0 < result["test_accuracy"] <= 1.0 and result["test_tokens"] > 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [10, 20, 30]
    table = pos_tagging.report(tmp_path)
    assert "| smoke |" in table
    assert (tmp_path / "accuracy.png").exists() and (tmp_path / "attention_map.png").exists()
