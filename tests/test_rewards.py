"""Reward registry (ms-swift's ``orms``) and the built-in ``accuracy`` / ``format`` rewards."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rewards import ORM, UnknownRewardError, get_reward, orms


def test_accuracy_compares_the_last_number():
    accuracy = get_reward("accuracy")
    completions = ["12", "13", "7+5=12", "12 or 13", "<answer>12</answer>", "", "12.0", "twelve"]
    assert accuracy(completions, solution=["12"] * len(completions)) == [
        1.0,
        0.0,
        1.0,
        0.0,
        1.0,
        0.0,
        1.0,
        0.0,
    ]


def test_accuracy_solution_forms():
    accuracy = get_reward("accuracy")
    assert accuracy(["-3", "1000", "x"], solution=[-3, "so #### 1,000", None]) == [1.0, 1.0, None]
    # No number in the solution: normalised string comparison.
    assert accuracy([" Paris ", "Lyon"], solution=["paris", "Paris"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="solution"):
        accuracy(["1"])
    with pytest.raises(ValueError, match="2 completions"):
        accuracy(["1", "2"], solution=["1"])


@given(st.integers(min_value=-(10**6), max_value=10**6))
def test_accuracy_is_exact_on_integers(n):
    accuracy = get_reward("accuracy")
    assert accuracy([str(n), str(n + 1), f"The answer is {n}."], solution=[str(n)] * 3) == [1.0, 0.0, 1.0]


def test_format_reward():
    fmt = get_reward("format")
    completions = [
        "12",
        " -3\n",
        "12 apples",
        "",
        "<think>add</think>\n<answer>3</answer>",
        "<think>a</think><answer>3</answer>!",
    ]
    assert fmt(completions, solution=["12"] * len(completions)) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]


def test_builtin_rewards_are_registered_under_ms_swift_names():
    assert {"accuracy", "format"} <= set(orms)
    assert get_reward("accuracy") is get_reward("accuracy")  # a class is instantiated once


def test_plugin_registration(monkeypatch):
    class Brevity(ORM):
        def __call__(self, completions, **kwargs):
            return [1.0 if len(c) < 3 else 0.0 for c in completions]

    monkeypatch.setitem(orms, "brevity", Brevity)
    assert get_reward("brevity")(["ab", "abcd"]) == [1.0, 0.0]
    monkeypatch.setitem(orms, "lengthy", lambda completions, **kw: [float(len(c)) for c in completions])
    assert get_reward("lengthy")(["ab"]) == [2.0]

    class Other(Brevity):
        pass

    first = get_reward("brevity")
    monkeypatch.setitem(orms, "brevity", Other)  # re-registering replaces the cached instance
    assert isinstance(get_reward("brevity"), Other) and get_reward("brevity") is not first


def test_unknown_name_lists_registered_and_closest():
    with pytest.raises(KeyError) as err:
        get_reward("acuracy")
    assert isinstance(err.value, UnknownRewardError)
    message = str(err.value)
    assert message.startswith("unknown reward function 'acuracy'")
    assert "did you mean 'accuracy'?" in message and "format" in message and "\n" not in message


def test_orm_base_class_must_be_implemented():
    with pytest.raises(NotImplementedError):
        ORM()(["x"])
