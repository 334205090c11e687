"""Tests of runner.tracking.tags: how values and names are written to MLflow."""

from __future__ import annotations

from runner.tracking.tags import max_param_chars, max_tag_chars, param_value, safe_key, shorten


def test_param_value_is_stable():
    assert param_value(True) == "true" and param_value(False) == "false"
    assert param_value(1) == "1" and param_value(1.0) == "1.0" and param_value(1e-5) == "1e-05"
    assert param_value([3, 32, 32]) == "[3, 32, 32]"
    assert param_value("sgd") == "sgd"


def test_safe_key_replaces_what_mlflow_rejects():
    assert safe_key("model.kwargs.hidden") == "model.kwargs.hidden"
    assert safe_key("best/val/loss: a-b_c") == "best/val/loss: a-b_c"
    assert safe_key("sweep.a|b=c,d") == "sweep.a_b_c_d"
    assert safe_key("optim.lr[0]") == "optim.lr_0_"


def test_shorten_keeps_the_limit_and_says_where_the_rest_is():
    assert shorten("abc", 10, "there") == "abc"
    marker = "...[truncated from 100 chars; full text in artifact a.txt]"
    cut = shorten("x" * 100, 70, "artifact a.txt")
    assert cut == "x" * (70 - len(marker)) + marker and len(cut) == 70


def test_mlflow_limits():
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH

    assert (max_param_chars(), max_tag_chars()) == (MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH)
