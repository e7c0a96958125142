"""Reward registry (ms-swift's ``orms``, entry points, config-taking classes) and the built-in rewards
(hand-worked tables from ms-swift's definitions)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from config import config_from_dict
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


# ---------------------------------------------------------------- ms-swift built-ins, hand-worked tables


def cfg_with(**reward):
    return config_from_dict({"reward": {"reward_funcs": ["accuracy"], **reward}})


@pytest.mark.parametrize(
    ("completion", "solution", "expected"),
    [
        ("\\boxed{\\frac{1}{2}}", "$\\frac{1}{2}$", 1.0),  # math-verify: LaTeX vs LaTeX
        ("The answer is $0.5$.", "$\\frac{1}{2}$", 1.0),  # equivalent values
        ("\\boxed{3}", "$\\frac{1}{2}$", 0.0),
        ("<answer>0.75</answer>", "<answer>\\frac{3}{4}</answer>", 1.0),  # both tagged: parse inside the tags
        ("<answer>1/2</answer>", "0.5", 1.0),
        ("so it is 7", "$7$", 1.0),  # no LaTeX answer: the last-number fallback
        ("7 or 8", "$7$", 0.0),
        ("no idea", "$7$", 0.0),
        (" Paris ", "paris", 1.0),  # the gold does not parse: normalised string match
        ("<answer>Lyon</answer>", "Paris", 0.0),
    ],
)
def test_accuracy_table(completion, solution, expected):
    assert get_reward("accuracy")([completion], solution=[solution]) == [expected]


def test_react_format_table():
    completions = [
        '<think>plan</think>\nAction: search\nAction Input: {"q": 1}',  # thought, then a tool call
        "Action: search\nAction Input: {}",  # no thought
        "<think>x</think> Action: a",  # no Action Input
        "<think>x</think>\nAction Input: {} Action: a",  # wrong order
    ]
    assert get_reward("react_format")(completions) == [1.0, 0.0, 0.0, 0.0]


def test_format_accepts_the_r1_layout_only_with_nothing_after():
    fmt = get_reward("format")
    completions = ["<think>a</think>\n<answer>3</answer>", "<answer>3</answer>", "<think>a</think><answer>3</answer>!"]
    assert fmt(completions) == [1.0, 0.0, 0.0]


def test_cosine_table():
    # cosine_max_len = 100 and ms-swift's defaults: correct 1.0 -> 0.5, wrong -0.5 -> 0.0 over 0..100 tokens.
    # r(L) = r_max - (r_max - r_0) * (1 + cos(pi L / 100)) / 2
    cosine = get_reward("cosine", cfg_with(cosine_max_len=100))
    lengths = [0, 25, 50, 100, 0, 50, 100]
    completions = ["$4$", "$4$", "$4$", "$4$", "$5$", "$5$", "$5$"]
    got = cosine(completions, completion_ids=[[7] * n for n in lengths], solution=["4"] * 7)
    assert got == pytest.approx([1.0, 0.5 + 0.25 * (1 + 2**-0.5), 0.75, 0.5, -0.5, -0.25, 0.0])
    assert cosine(["$4$"], completion_ids=[[1]], solution=[None]) == [None]  # no solution: not applicable


def test_cosine_max_len_defaults_to_max_completion_length():
    cfg = config_from_dict({"reward": {"reward_funcs": ["cosine"]}, "grpo": {"max_completion_length": 10}})
    cosine = get_reward("cosine", cfg)
    assert cosine(["$1$"], completion_ids=[[0] * 10], solution=["1"]) == pytest.approx([0.5])


@pytest.mark.parametrize(
    ("text", "n_grams", "max_penalty", "expected"),
    [
        ("", 3, -1.0, 0.0),
        ("a b", 3, -1.0, 0.0),  # fewer words than n
        ("a b c", 3, -1.0, 0.0),  # one trigram, unique
        ("a b c a b c", 3, -1.0, -0.25),  # abc bca cab abc: 3 unique of 4
        ("A a a a a", 3, -1.0, -2 / 3),  # lower-cased: aaa x3, 1 unique of 3
        ("x y x y", 2, -0.5, -0.5 / 3),  # xy yx xy: 2 unique of 3
    ],
)
def test_repetition_table(text, n_grams, max_penalty, expected):
    repetition = get_reward("repetition", cfg_with(repetition_n_grams=n_grams, repetition_max_penalty=max_penalty))
    assert repetition([text]) == [pytest.approx(expected)]


def test_soft_overlong_table():
    # soft_max_length 100, soft_cache_length 20: free up to 80 tokens, then -1/20 per token.
    cfg = config_from_dict(
        {"reward": {"reward_funcs": ["soft_overlong"], "soft_max_length": 100, "soft_cache_length": 20}}
    )
    soft = get_reward("soft_overlong", cfg)
    lengths = [50, 80, 90, 100, 110]
    assert soft(["x"] * 5, completion_ids=[[0] * n for n in lengths]) == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.5])


def test_soft_overlong_needs_a_cache_length():
    from config import ConfigError

    with pytest.raises(ConfigError, match="reward.soft_cache_length must be set"):
        config_from_dict({"reward": {"reward_funcs": ["soft_overlong"]}})
    with pytest.raises(ConfigError, match=r"soft_cache_length=600 must be below .*512, from grpo"):
        config_from_dict({"reward": {"reward_funcs": ["soft_overlong"], "soft_cache_length": 600}})


def test_all_ms_swift_builtins_are_registered():
    assert {"accuracy", "format", "react_format", "cosine", "repetition", "soft_overlong", "code_execution"} <= set(
        orms
    )


# ---------------------------------------------------------------- registration: config, entry points


def test_a_class_taking_config_is_built_with_the_run_config(monkeypatch):
    class Scaled(ORM):
        def __init__(self, config):
            self.scale = config.reward.timeout_s

        def __call__(self, completions, **kwargs):
            return [self.scale] * len(completions)

    monkeypatch.setitem(orms, "scaled", Scaled)
    cfg = cfg_with(timeout_s=7.5)
    assert get_reward("scaled", cfg)(["a"]) == [7.5]
    assert get_reward("scaled", cfg) is get_reward("scaled", cfg)


def test_entry_point_group_registers_rewards(tmp_path, monkeypatch):
    import importlib

    (tmp_path / "ep_rewards_mod.py").write_text(
        "class Shout:\n    def __call__(self, completions, **kwargs):\n"
        "        return [float(c.isupper()) for c in completions]\n"
    )
    dist = tmp_path / "ep_rewards_mod-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-rewards-mod\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rollstream.rewards]\nshout = ep_rewards_mod:Shout\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    from rewards import registered_names

    assert "shout" in registered_names() and "shout" not in orms
    assert get_reward("shout")(["HEY", "hey"]) == [1.0, 0.0]
