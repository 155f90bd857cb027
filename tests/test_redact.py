"""Tests for dlwatch.redact."""

from __future__ import annotations

import collections
import json
import string

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dlwatch.redact import MASK, is_secret_name, outbound, redact, redact_argv

# Fake but well-shaped secrets (built by concatenation so no scanner flags this file).
AWS_ID = "AKIA" + "IOSFODNN7EXAMPLE"
AWS_STS_ID = "ASIA" + "Y34FZKBOKMUTVV7A"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/" + "bPxRfiCYEXAMPLEKEY"
GCP_KEY = "AIza" + "SyD-9tSrke72PouQMnMX-a7eZSW0jkFMBWY"
GOOGLE_OAUTH = "ya29." + "a0AfH6SMBx3kLmN0pQrStUvWxYz_12-ab"
HF = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz12345678"
GH = "ghp_" + "1234567890abcdefghijABCDEFGHIJ123456"
GHO = "gho_" + "16C7e42F292c6912E7710c838347Ae178B4a"
GHS = "ghs_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZ0123456789"
GH_PAT = "github_pat_" + "11ABCDEFG0123456789_abcdefghijklmnop"
SLACK = "xoxb-" + "123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx"
JWT = "eyJhbGciOiJIUzI1NiJ9." + "eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
PEM_BODY = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7\nVJTUt9Us8cKjMzEfYyjiWA4R4/M2bS1GB4t7NXp98C3SC6dV\n"


# --------------------------------------------------------------------------
# key / option forms


@pytest.mark.parametrize(
    "text, expected",
    [
        ("--api-token=abc123XYZ", "--api-token=***"),
        ("python train.py --api-token=abc123XYZ --epochs 3", "python train.py --api-token=*** --epochs 3"),
        ("python train.py --password hunter2 --epochs 3", "python train.py --password *** --epochs 3"),
        ("train.py --password 'my pass' -v", "train.py --password '***' -v"),
        ("password=hunter2", "password=***"),
        ("db password=hunter2, retries=3", "db password=***, retries=3"),
        ('password="hunter 2" user=bob', 'password="***" user=bob'),
        ('{"password": "hunter2", "user": "bob"}', '{"password": "***", "user": "bob"}'),
        ("{'password': 'hunter2', 'user': 'bob'}", "{'password': '***', 'user': 'bob'}"),
        ('{"api_key": 123456789}', '{"api_key": ***}'),
        ('{"token": "a\\"b", "n": 1}', '{"token": "***", "n": 1}'),
        ("PASSWORD: hunter2", "PASSWORD: ***"),
        ("db:\n  password: hunter 2 yes\n  host: x", "db:\n  password: ***\n  host: x"),
        ("- client_secret: abc", "- client_secret: ***"),
        ("X-Api-Key: abcdef", "X-Api-Key: ***"),
        ("https://h/x?token=abc123&x=1", "https://h/x?token=***&x=1"),
        ("https://h/x?a=1&access_token=abc#123", "https://h/x?a=1&access_token=***"),
        ("export HF_TOKEN=hf_short", "export HF_TOKEN=***"),
        ("MY_PASSWD=x1 OTHER=2", "MY_PASSWD=*** OTHER=2"),
        ("apikey=k1 APIKEY=k2 api-key=k3 credentials=k4", "apikey=*** APIKEY=*** api-key=*** credentials=***"),
        ("secret=s", "secret=***"),
        # the rule as written: any name containing a secret word
        ("--tokenizer-path /data/tok", "--tokenizer-path ***"),
        ("num_tokens=5", "num_tokens=***"),
        # no value / literal booleans and None are not secrets
        ("use_auth_token=True", "use_auth_token=True"),
        ("--use-auth-token --epochs 3", "--use-auth-token --epochs 3"),
        ('{"token": null, "password": false}', '{"token": null, "password": false}'),
        ("password=", "password="),
        ("TOKENIZERS_PARALLELISM=false", "TOKENIZERS_PARALLELISM=false"),
        ("--token=<YOUR_TOKEN>", "--token=<YOUR_TOKEN>"),
    ],
)
def test_key_forms(text: str, expected: str) -> None:
    assert redact(text) == expected


def test_compact_and_pretty_json() -> None:
    assert redact('{"a":1,"token":"x","b":2}') == '{"a":1,"token":"***","b":2}'
    assert redact('{\n  "client_secret":\n    "abc",\n  "n": 1\n}') == '{\n  "client_secret":\n    "***",\n  "n": 1\n}'


def test_non_secret_key_does_not_hide_a_secret() -> None:
    # found by fuzzing: a non-secret key with an unterminated quote used to swallow the rest
    assert redact("x.y=' --password=abcdefghijkl'") == "x.y=' --password=***'"
    assert redact("AKIA" + "IOSFODNN7EXAMPLE=--token=abc") == "***=--token=***"
    assert redact("a: 'x, password: y'") == "a: 'x, password: ***"  # line form: value runs to end of line


def test_unterminated_quote_is_redacted_to_end_of_line() -> None:
    assert redact('password="abc def\nnext') == 'password="***\nnext'


def test_aws_secret_after_key_name() -> None:
    assert redact(f"aws_secret_access_key = {AWS_SECRET}") == "aws_secret_access_key = ***"
    assert redact(f"AWS_SECRET_ACCESS_KEY={AWS_SECRET}") == "AWS_SECRET_ACCESS_KEY=***"
    assert redact(f'"SecretAccessKey": "{AWS_SECRET}"') == '"SecretAccessKey": "***"'
    # 40 base64 chars after a non-secret name are left alone
    assert redact(f"checksum = {AWS_SECRET}") == f"checksum = {AWS_SECRET}"


# --------------------------------------------------------------------------
# value patterns


@pytest.mark.parametrize("secret", [AWS_ID, AWS_STS_ID, GCP_KEY, GOOGLE_OAUTH, HF, GH, GHO, GHS, GH_PAT, SLACK])
def test_positional_token_patterns(secret: str) -> None:
    text = f"loading with {secret} now"
    assert redact(text) == "loading with *** now"
    assert secret not in redact(f"({secret})")


def test_bearer() -> None:
    assert redact(f"Authorization: Bearer {JWT}") == "Authorization: Bearer ***"
    assert redact("curl -H 'authorization: bearer abc123def456'") == "curl -H 'authorization: bearer ***'"
    assert redact("the bearer of bad news") == "the bearer of bad news"
    assert redact("the Bearer tokenless") == "the Bearer tokenless"


def test_private_key_block() -> None:
    text = f"key:\n-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}-----END RSA PRIVATE KEY-----\ndone"
    out = redact(text)
    assert out == "key:\n-----BEGIN RSA PRIVATE KEY-----***-----END RSA PRIVATE KEY-----\ndone"
    for kind in ("", "EC ", "OPENSSH ", "ENCRYPTED "):
        t = f"-----BEGIN {kind}PRIVATE KEY-----\n{PEM_BODY}-----END {kind}PRIVATE KEY-----"
        assert "MIIE" not in redact(t)
    # JSON-escaped, as in a GCP service-account file
    sa = '{"private_key": "-----BEGIN PRIVATE KEY-----\\nMIIEvQIBADAN\\n-----END PRIVATE KEY-----\\n"}'
    assert redact(sa) == '{"private_key": "-----BEGIN PRIVATE KEY-----***-----END PRIVATE KEY-----\\n"}'
    # truncated block: redacted to the end
    assert redact(f"-----BEGIN PRIVATE KEY-----\n{PEM_BODY}") == "-----BEGIN PRIVATE KEY-----***"


def test_url_credentials() -> None:
    assert redact("https://user:pw@host/path") == "https://user:***@host/path"
    assert redact("git clone https://x-access-token:abc:def@github.com/o/r.git") == (
        "git clone https://x-access-token:***@github.com/o/r.git"
    )
    assert redact("s3://bucket/key and https://host:8080/path") == "s3://bucket/key and https://host:8080/path"
    assert redact("https://user@host/path") == "https://user@host/path"


# --------------------------------------------------------------------------
# ordinary text stays byte-identical

TRACEBACK = """Traceback (most recent call last):
  File "/home/me/train.py", line 42, in <module>
    for batch in loader:
  File "/usr/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1133, in _try_get_data
    data = self._data_queue.get(timeout=timeout)
  File "/usr/lib/python3.11/multiprocessing/queues.py", line 113, in get
    if not self._poll(timeout):
RuntimeError: DataLoader worker (pid(s) 4242) exited unexpectedly
"""

HF_FORK_WARNING = (
    "huggingface/tokenizers: The current process just got forked, after parallelism has already been used. "
    "Disabling parallelism to avoid deadlocks...\nTo disable this warning, you can either:\n"
    "\t- Avoid using `tokenizers` before the fork if possible\n"
    "\t- Explicitly set the environment variable TOKENIZERS_PARALLELISM=(true | false)\n"
)


@pytest.mark.parametrize(
    "text",
    [
        "RuntimeError: Too many open files. Communication with the workers is no longer possible. "
        "Please increase the limit using `ulimit -n` in the shell or change the sharing strategy by calling "
        "`torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning of your code",
        "/data/shards/train-00001-of-00128.parquet",
        "C:\\Users\\me\\data\\tokenizer.json",
        "loaded tokenizer.json from /models/bert",
        "the token was rejected",
        "token",
        "Invalid token",
        "DataLoader worker (pid 123) is killed by signal: Bus error",
        "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).",
        TRACEBACK,
        "tokenize.TokenError: ('EOF in multi-line statement', (3, 0))",
        HF_FORK_WARNING,
        "https://huggingface.co/bert-base-uncased/resolve/main/tokenizer.json",
        "batch_size=32 num_workers=8 pin_memory=True",
        "epoch 3: loss=0.25 lr=1e-4",
        "ya29. is the prefix of an OAuth token",
        "hf_hub_download failed",
        "",
        "\x00\ud800 weird \u2603",
    ],
)
def test_ordinary_text_is_untouched(text: str) -> None:
    assert redact(text) == text


def test_non_str_returned_unchanged() -> None:
    for obj in (None, 1, 2.5, b"password=x", ["password=x"], object()):
        assert redact(obj) is obj  # type: ignore[arg-type]


def test_is_secret_name() -> None:
    assert is_secret_name("HF_TOKEN") and is_secret_name("Api-Key") and is_secret_name("db_passwd")
    assert not is_secret_name("tokn") and not is_secret_name(3) and not is_secret_name("private_key_id")


# --------------------------------------------------------------------------
# idempotence


@pytest.mark.parametrize(
    "text",
    [
        "--api-token=abc --password x y",
        '{"password": "a\\"b"} password="x',
        f"Bearer {JWT} {HF} https://u:p@h?token=t&x=1",
        f"-----BEGIN PRIVATE KEY-----\n{PEM_BODY}",
        "password: a, token=b; secret: 'c'",
        f"aws_secret_access_key = {AWS_SECRET}",
        # found by fuzzing (quote re-pairing after a key name was masked; "/" removed from a URL)
        'PASSWORD: "token": "--password"token": --tokenizer-path [ya29.abcdefghijk--[a',
        '://x:a\\"b,--token=/&@*--=https://u:p@h@',
    ],
)
def test_idempotent_examples(text: str) -> None:
    once = redact(text)
    assert redact(once) == once


# --------------------------------------------------------------------------
# argv


def test_redact_argv() -> None:
    argv = [
        "python",
        "train.py",
        "--password",
        "hunter2",
        "--api-token=abc=def",
        "--token",
        "--epochs",
        "3",
        "HF_TOKEN=hf_x y",
        "--url",
        "https://u:pw@h/x",
        GH,
        "--use-auth-token",
        "true",
        "--tokenizer-path",
        "/p",
    ]
    assert redact_argv(argv) == [
        "python",
        "train.py",
        "--password",
        "***",
        "--api-token=***",
        "--token",
        "--epochs",
        "3",
        "HF_TOKEN=***",
        "--url",
        "https://u:***@h/x",
        "***",
        "--use-auth-token",
        "true",
        "--tokenizer-path",
        "***",
    ]
    assert redact_argv(("--secret", "a b c")) == ["--secret", "***"]
    assert redact_argv([]) == []
    assert redact_argv("--password=x") == ["--password=***"]
    assert redact_argv(None) == []  # type: ignore[arg-type]
    assert redact_argv(["--password", 5, "x"]) == ["--password", 5, "x"]  # type: ignore[list-item]


# --------------------------------------------------------------------------
# objects


def test_outbound_objects() -> None:
    """Objects through the one redaction point (redact_obj, its unused older twin, is gone)."""
    Pt = collections.namedtuple("Pt", "a b")
    obj = {
        "password": 12345,
        "api_key": {"nested": "x"},
        "token": None,
        "use_auth_token": True,
        "secret": "",
        "cmd": ["train.py", "--password=hunter2", ("x", f"Bearer {JWT}")],
        "pt": Pt("https://u:pw@h", 3),
        "tags": {"plain", "password=p"},
        "n": 3,
        "blob": b"password=raw",
    }
    out = outbound(obj)
    tags = out.pop("tags")
    assert sorted(tags) == ["password=***", "plain"]  # a set becomes a list, in the set's order
    assert out == {
        "password": "***",
        "api_key": "***",
        "token": None,
        "use_auth_token": True,
        "secret": "",
        "cmd": ["train.py", "--password=***", ["x", "Bearer ***"]],
        "pt": ["https://u:***@h", 3],
        "n": 3,
        "blob": "password=***",  # bytes are text before they are redacted
    }
    assert obj["password"] == 12345 and obj["blob"] == b"password=raw"  # input untouched
    dd = collections.defaultdict(list, {"token": "t", "x": "ok"})
    assert outbound(dd) == {"token": "***", "x": "ok"}
    assert outbound({"https://u:pw@h": 1}) == {"https://u:***@h": 1}  # keys are redacted too
    assert outbound("password=x") == "password=***"

    class Odd:
        def __str__(self) -> str:
            return "password=hidden"

    assert outbound(Odd()) == "password=***"  # any object: converted to text, then redacted


def test_outbound_cycles_and_depth() -> None:
    a: list = ["password=x"]
    a.append(a)
    assert outbound(a) == ["password=***", "<cycle>"]
    deep: list = []
    cur = deep
    for _ in range(1000):
        nxt: list = []
        cur.append(nxt)
        cur = nxt
    flat = outbound(deep)  # must not raise: nesting beyond the limit becomes the mask
    for _ in range(1000):
        if flat == MASK:
            break
        (flat,) = flat
    assert flat == MASK


# --------------------------------------------------------------------------
# linear time on pathological input (bounded by pytest-timeout, no timing assert)

MB = 1 << 20


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "unit",
    [
        "token",  # one 1 MB key-name run
        "a=",  # half a million non-secret heads
        "--password ",  # many separate-argument values
        "\npassword: x ",  # many line-start keys
        '"password": ',  # quoted keys
        'password="\\',  # escapes inside an unterminated quote
        "'",
        "://a:",  # URL userinfo without "@"
        "-----BEGIN ",  # private-key headers without "PRIVATE KEY"
        "Bearer ",
        "hf_",
        "A" * 39 + "=",  # almost an AWS secret, over and over
        "mysql -p",  # issue 18: client words and -p options
        "mysql ",
        "Cookie: a=b; ",
        "Authorization: Basic ",
        'x"',  # quotes inside an option value
        "xghp_",  # glued token prefixes
        "ask-",
        "sshpass ",  # issue 29: command-bound forms and the new shapes
        "sshpass -e ",
        "curl -u a:",
        "curl ",
        "wandb login ",
        "WANDB_API_KEY ",
        "response=",
        "://u:p@h/",  # a URL password with "@" and "/", the last "@" wins
        "AccountKey=",
    ],
)
def test_pathological_input_finishes(unit: str) -> None:
    text = (unit * (MB // len(unit) + 1))[:MB]
    out = redact(text)
    assert isinstance(out, str)


# --------------------------------------------------------------------------
# property tests

SECRET_WORDS_LOW = (
    "token",
    "secret",
    "password",
    "passwd",
    "api_key",
    "apikey",
    "api-key",
    "credential",
    "passphrase",
    "signature",
    "pass",
    "pw",
    "key",
    "auth",
    "sig",
)
# Literal prefixes of the name-independent patterns; excluded from "clean" text.
PATTERN_MARKERS = (
    "akia",
    "asia",
    "aiza",
    "ya29",
    "hf_",
    "gh",
    "github_pat_",
    "xox",
    "bearer",
    "private key",
    "basic",
    "sk-",
    "sk_",
    "rk_",
    "gl",
    "sg.",
    "npm_",
    "pypi-",
    "eyj",
)

CLEAN_ALPHABET = st.characters(blacklist_characters="=:@", blacklist_categories=("Cs",)) | st.sampled_from(
    list(string.ascii_letters + string.digits + " -_./\n\t\"'(){}[],;&?")
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.text(CLEAN_ALPHABET, max_size=200))
def test_clean_text_unchanged(text: str) -> None:
    low = text.lower()
    assume(not any(w in low for w in SECRET_WORDS_LOW))
    assume(not any(p in low for p in PATTERN_MARKERS))
    assert redact(text) == text


MIXED = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        [
            "=",
            ":",
            "@",
            "://",
            " ",
            "\n",
            "-",
            "--",
            '"',
            "'",
            "\\",
            ",",
            "&",
            "?",
            "{",
            "(",
            "***",
            "password",
            "token",
            "Secret",
            "API_KEY",
            "--password",
            "--token=",
            "Bearer ",
            "https://u:p@h",
            "-----BEGIN PRIVATE KEY-----",
            "-----END PRIVATE KEY-----",
            "hf_" + "a" * 30,
            AWS_ID,
            "true",
            "Error",
            " = ",
            AWS_SECRET,
        ]
    ),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(MIXED, max_size=12).map("".join))
def test_never_raises_and_idempotent(text: str) -> None:
    once = redact(text)
    assert isinstance(once, str)
    assert redact(once) == once


SECRET_VALUE = st.text(string.ascii_letters + string.digits + "!#$%^*+/~.", min_size=12, max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60), SECRET_VALUE, st.text(max_size=60))
def test_planted_password_never_survives(prefix: str, secret: str, suffix: str) -> None:
    assume(secret not in prefix + suffix)
    out = redact(f"{prefix} --password={secret}{suffix}")
    assert secret not in out
    argv_out = redact_argv(["prog", "--password", secret, f"--password={secret}"])
    assert secret not in "".join(argv_out)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(
                st.sampled_from(["a", "token", "x_password", "b"]) | st.text(max_size=5), children, max_size=4
            )
            | st.tuples(children, children)
        ),
        max_leaves=20,
    )
)
def test_outbound_never_raises(obj: object) -> None:
    json.dumps(outbound(obj))  # and gives plain JSON data


def _redact_without_gate(text: str) -> str:
    from dlwatch.redact import _redact_to_fixpoint

    return _redact_to_fixpoint(text)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        MIXED
        | st.sampled_from(
            [
                "sk-" + "a" * 24,
                "glpat-" + "b" * 20,
                "\u212aey=v1",
                "PW = x",
                "Sig=1",
                "eyJ" + "a" * 8 + ".eyJ" + "b" * 8 + ".c",
                "Basic Zm9vOmJhcg==",
            ]
        ),
        max_size=10,
    ).map("".join)
)
def test_fast_gate_never_skips_a_redaction(text: str) -> None:
    """redact() returns clean text at once when no trigger occurs; that shortcut must change nothing."""
    assert redact(text) == _redact_without_gate(text)


@pytest.mark.parametrize(
    "text",
    [
        # healthy look-alikes of the issue-9 rules: names that merely contain pass/key/auth/sig,
        # comparisons and augmented assignments, prose, and the usual ML command lines
        "if x == y and token_count += 1",
        "compass=north keyboard=us monkey=1 author: me bypass=0 sig_figs=3 keys=4",
        "signal: SIGKILL (the training process was killed)",
        "pip install scikit-learn; sk-learn is not a token",
        "the basic idea: stack, do not concatenate",
        "torchrun --nproc-per-node 8 train.py --epochs -1 --lr 3e-4",
        "https://github.com/pytorch/pytorch/issues/1355#issuecomment-1",
        "s3://bucket/key=value/part-0001.parquet",
        'Thread 0x7f (most recent call first):\n  File "/opt/venv/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py", line 308 in _worker_loop',
    ],
)
def test_issue9_look_alikes_are_untouched(text: str) -> None:
    assert redact(text) == text


# --------------------------------------------------------------------------
# issue 18: tokens glued to a word, shapes that were missed, over-redaction of the last round

GLUED_TOKENS = [
    AWS_ID,
    GCP_KEY,
    GOOGLE_OAUTH,
    HF,
    GH,
    GHO,
    GHS,
    GH_PAT,
    SLACK,
    JWT,
    "glpat-" + "Z9y8X7w6V5u4T3s2R1q0",
    "sk-" + "A1b2C3d4E5f6G7h8I9j0K1l2",
    "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0_-x",
    "sk_live_" + "0123456789abcdefXYZ",
    "SG." + "abcdefghijklmnop.qrstuvwxyz012345",
    "npm_" + "a1" * 18,
    "pypi-AgE" + "b2" * 25,
]


@pytest.mark.parametrize("secret", GLUED_TOKENS)
@pytest.mark.parametrize("glue", ["shard_", "load_", "DS_", "x", "9", "é"])
def test_token_glued_to_a_word_is_redacted(glue: str, secret: str) -> None:
    for text in (f"{glue}{secret}", f"/data/{glue}{secret}/part-0.parquet", f"ValueError: bad {glue}{secret}: retry"):
        out = redact(text)
        assert secret not in out and secret[-12:] not in out, out
        assert glue in out  # the identifier in front stays


@pytest.mark.parametrize(
    "text, expected",
    [
        ("mysql -uroot -pS3cretPw db", "mysql -uroot -p*** db"),
        ("mysqldump -h db -p S3cretPw --all-databases > x.sql", "mysqldump -h db -p *** --all-databases > x.sql"),
        ("/usr/bin/mariadb -p'my pass' -e 'select 1'", "/usr/bin/mariadb -p'***' -e 'select 1'"),
        ("mysql -p -h host db", "mysql -p -h host db"),  # -p alone prompts: nothing to hide
        ("mysql -u x -pA1; ls -p docs", "mysql -u x -p***; ls -p docs"),  # only the client's own command
        ("Authorization: Basic dXNlcjpwYXNz", "Authorization: Basic ***"),
        ("Authorization: token ghx1234", "Authorization: token ***"),
        (
            "curl -H 'Proxy-Authorization: Basic Zm9v' https://h/x",
            "curl -H 'Proxy-Authorization: Basic ***' https://h/x",
        ),
        ("{'Authorization': 'Basic dXNlcjpwYXNz', 'n': 1}", "{'Authorization': 'Basic ***', 'n': 1}"),
        ("Authorization: Bearer <token>", "Authorization: Bearer <token>"),
        ("Cookie: sid=abc123; theme=dark", "Cookie: ***"),
        ("Set-Cookie: sid=abc123; Path=/; HttpOnly", "Set-Cookie: ***"),
        ('curl -H "Cookie: sid=1; t=2" https://h/x', 'curl -H "Cookie: ***" https://h/x'),
        ("curl --cookie sid=abc123 https://h/x", "curl --cookie *** https://h/x"),
        ('{"Cookie": "sid=abc123"}', '{"Cookie": "***"}'),
        ("db_pass=hunter2 db_user=bob", "db_pass=*** db_user=bob"),
        ("MYSQL_ROOT_PASS: hunter2", "MYSQL_ROOT_PASS: ***"),
        ("--redis.pass hunter2", "--redis.pass ***"),
        # over-redaction of the last round
        (
            'cmd = ["sh", "-c", "train --password x", "--epochs"]',
            'cmd = ["sh", "-c", "train --password ***", "--epochs"]',
        ),
        ('run("--password x", check=True)', 'run("--password ***", check=True)'),
        ("f(--password x), g", "f(--password ***), g"),
        ("http://host:8080/x@y.z", "http://host:8080/x@y.z"),
        ("see https://host:443/a/b@c.d?q=1#frag", "see https://host:443/a/b@c.d?q=1#frag"),
        ("https://user:secretpw@host:8080/x", "https://user:***@host:8080/x"),
    ],
)
def test_issue18_shapes(text: str, expected: str) -> None:
    assert redact(text) == expected
    assert redact(expected) == expected


@pytest.mark.parametrize(
    "text",
    [
        # look-alikes of the glued shapes: ordinary identifiers and paths stay byte-identical
        "/data/mask-rcnn_r50_fpn_coco_2017_train_val/images",
        "task-runner-pool_worker_thread_count=4",
        "pip install scikit-learn; sk-learn is not a token",
        "graph_hf_dataset_loader_cache_dir",
        "highs_and_lows weighs_total sighs_",
        "bypass=1 compass=north",
        "import mysql.connector; pymysql -p is not mysql's option",
        "ls -p docs; grep -p x",
        "the Authorization header is missing",
        "cookiecutter is a project template tool",
        "ASIA_PACIFIC region, MALAYSIA office",
    ],
)
def test_issue18_look_alikes_are_untouched(text: str) -> None:
    assert redact(text) == text
