"""`model.config` without transformers: the daemon's config JSON as an
attribute object with the same typed values and the class's aliases."""

from __future__ import annotations

import json

from nnd.models import _config

TEXT = json.dumps(
    {"config": {"model_type": "gpt2", "n_head": 4, "n_layer": 2, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True},
     "aliases": {"num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}}
)


def test_the_plain_config_has_typed_values_and_aliases():
    config = _config.Config(**{"values": json.loads(TEXT)["config"], "aliases": json.loads(TEXT)["aliases"]})
    assert config.n_head == 4 and config.num_attention_heads == 4 and config.num_hidden_layers == 2
    assert isinstance(config.layer_norm_epsilon, float) and config.tie_word_embeddings is True
    assert config.to_dict()["n_layer"] == 2 and config.get("missing", 7) == 7 and "num_hidden_layers" in config


def test_with_transformers_it_is_the_model_types_config_class():
    config = _config.build(TEXT, {})
    assert type(config).__name__ == "GPT2Config" and config.num_attention_heads == 4


def test_an_old_daemon_without_the_json_gives_its_summary():
    assert _config.build("", {"n_head": "4"}).n_head == "4"
