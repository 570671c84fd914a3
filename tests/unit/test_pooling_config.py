"""How a checkpoint's files decide embedding pooling (banyan/checkpoint/pooling.py): sentence-transformers' pooling
config, --pooling, Matryoshka truncation rules."""

from __future__ import annotations

import json

import pytest

from banyan.checkpoint.pooling import model_pooling
from banyan.errors import InvalidParameterError
from banyan.pooling_params import PoolingParams


def write(path, files: dict) -> None:
    for name, content in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(json.dumps(content))


ST_MODULES = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
              {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]


def test_a_plain_directory_pools_the_last_token_and_allows_no_truncation(tmp_path):
    write(tmp_path, {"config.json": {}})
    pooling = model_pooling(tmp_path)
    assert (pooling.pooling_type, pooling.source, pooling.matryoshka) == ("last", "default", False)
    pooling.check_dimensions(None, 64)
    pooling.check_dimensions(64, 64)  # all of it: no truncation
    with pytest.raises(InvalidParameterError, match="Matryoshka") as e:
        pooling.check_dimensions(32, 64)
    assert e.value.param == "dimensions"


@pytest.mark.parametrize("flag, expected", [("pooling_mode_mean_tokens", "mean"), ("pooling_mode_lasttoken", "last")])
def test_sentence_transformers_config_names_the_mode(tmp_path, flag, expected):
    write(tmp_path, {"config.json": {}, "modules.json": ST_MODULES, "1_Pooling/config.json": {flag: True}})
    assert model_pooling(tmp_path).pooling_type == expected
    assert model_pooling(tmp_path, override="last").pooling_type == "last"


def test_an_unimplemented_mode_refuses_embeddings_naming_the_override(tmp_path):
    write(tmp_path, {"config.json": {}, "modules.json": ST_MODULES, "1_Pooling/config.json": {"pooling_mode_cls_token": True}})
    pooling = model_pooling(tmp_path)
    with pytest.raises(InvalidParameterError, match="--pooling last or mean"):
        pooling.require_type()


def test_matryoshka_dimensions_limit_the_choices(tmp_path):
    write(tmp_path, {"config.json": {"matryoshka_dimensions": [16, 32]}})
    pooling = model_pooling(tmp_path)
    pooling.check_dimensions(16, 64)
    with pytest.raises(InvalidParameterError, match="one of 16, 32"):
        pooling.check_dimensions(64, 64)
    write(tmp_path, {"config.json": {"is_matryoshka": True}})
    model_pooling(tmp_path).check_dimensions(7, 64)
    with pytest.raises(InvalidParameterError, match=r"\[1, 64\]"):
        model_pooling(tmp_path).check_dimensions(65, 64)


def test_unreadable_files_fall_back_to_the_default(tmp_path):
    write(tmp_path, {"config.json": {}})
    (tmp_path / "modules.json").write_text("{not json")
    assert model_pooling(tmp_path).pooling_type == "last"


def test_bad_settings_are_typed_errors(tmp_path):
    with pytest.raises(InvalidParameterError):
        model_pooling(tmp_path, override="max")
    with pytest.raises(InvalidParameterError):
        PoolingParams(dimensions=0)
