"""Redaction of secret-looking values in text, command lines and objects.

Stdlib only, regexes compiled once at import, so the logging layer and the
report writer can import it cheaply.  Nothing in here raises: text that is not
a ``str`` is returned unchanged, and every pattern runs in linear time (no
nested or overlapping unbounded quantifiers).

Public API
----------
``redact(text) -> str``
    Replace secret-looking values with ``***``.  The key / option name stays
    visible (``--api-token=***``, ``"password": "***"``,
    ``https://user:***@host``) so the text stays readable.
``redact_argv(argv) -> list[str]``
    Same for a command line given as a list of arguments.
``warn(message, category, stacklevel)``
    ``warnings.warn`` through the one redaction point: what Python prints on
    the program's stderr is redacted (a thread name, a path in a warning).
``outbound(obj)``
    The one redaction point: everything dlwatch writes to a file or prints
    passes through it (``dlwatch._fs`` writers, events, timeline, logs, CLI
    output).  Recursively redacts ``str`` values and dict keys inside dicts /
    lists / tuples / sets; a dict value whose *key* looks secret becomes ``***``
    whatever its type; bytes, exceptions and any other object become text
    *before* they are redacted.

The rules (exactly what is implemented)
---------------------------------------
A *secret name* is any key / option name that contains, case-insensitively,
one of: ``token``, ``secret``, ``password``, ``passwd``, ``api_key``,
``apikey``, ``api-key``, ``credential``, ``passphrase``, ``signature``
(``X-Amz-Signature``, ``X-Goog-Signature``), ``cookie``, ``authorization``, or
that ends in one of :data:`SECRET_SUFFIXES` (``_pass``, ``_account_key``; ``-`` and ``.`` read as
``_``: ``db_pass``, ``redis.pass``; but not a pass of :data:`PASS_NOT_PASSWORD`:
``forward_pass``, ``first_pass``), or that is exactly (leading
dashes dropped, ``-`` read as ``_``) one of ``pass``, ``pw``, ``pwd``, ``sig``
(SAS tokens), ``accountkey``/``account_key``, ``sharedaccesskey``/``shared_access_key``
(Azure connection strings: ``...;AccountKey=***;...``), or, as an option only, ``--key`` / ``--auth`` (``key=`` and
``key:`` are S3 object keys, partitions and dict keys far more often).  Name characters are letters, digits,
``_``, ``.`` and ``-``.  The rule is applied as written, with no exceptions
for "harmless-looking" names: ``--tokenizer-path x`` becomes
``--tokenizer-path ***`` and ``num_tokens=5`` becomes ``num_tokens=***``.

The value of a secret name is redacted in these forms:

1. ``name=VALUE`` or ``name = VALUE`` anywhere (not ``==``; covers ``--api-token=V``, ``password=V``,
   ``HF_TOKEN=V``, URL queries ``?token=V&x=1``).  An unquoted VALUE runs up to
   whitespace or one of ``& , ; ' " ) ] }`` and must not start with a bracket
   or ``<`` (so ``TOKENIZERS_PARALLELISM=(true | false)`` and
   ``--token=<YOUR_TOKEN>`` placeholders stay).  A quoted VALUE
   (``'...'`` / ``"..."``, backslash escapes honoured, unterminated quote runs
   to the end of the line) keeps its quotes: ``password="***"``.
2. ``"name": VALUE`` / ``'name': VALUE`` (JSON, Python dict reprs), anywhere
   the opening quote is not directly preceded by a word character, ``*`` or
   another quote.
3. ``name: VALUE`` (YAML, HTTP-header or env-dump style) when ``name`` starts a
   line (after optional indentation and an optional ``- `` list marker) or
   follows a blank, a quote or one of ``{ , ; ( [``.  An unquoted VALUE is the rest of the
   line up to ``, ; } ]``.  Names that look like exception classes (ending in
   ``Error``, ``Exception`` or ``Warning``, e.g. ``tokenize.TokenError: ...``)
   are not treated as keys, so tracebacks stay intact.
4. ``-name VALUE`` / ``--name VALUE`` (option and value separated by blanks,
   option preceded by whitespace, a quote, ``( [ , =`` or start of text);
   VALUE may start with ``-`` (``--password -x9``) unless it is a long option
   (``--epochs``).
   An unquoted VALUE ends at a blank, or at a quote followed by a blank, one of
   ``, ; ) ] }`` or the end; closing ``, ; ) ] }`` glued to it stay
   (``"--password x",`` -> ``"--password ***",``).
5. ``name = VALUE`` / ``name: VALUE`` with any blanks, when VALUE is exactly 40
   base64 characters (the shape of an AWS secret access key).
6. ``-pVALUE`` / ``-p VALUE`` in the command of a client of :data:`PASSWORD_P_CLIENTS`
   (``mysql``, ``mysqldump``, ``mariadb`` ...; the command runs from the client word
   to ``;``, ``|``, ``&`` or a newline).  A bare ``-p`` (a prompt) stays.  In ``sshpass``'s
   command only sshpass's own options count (``sshpass -p *** ssh -p 2222 host``: the
   second ``-p`` is ssh's port).
7. ``-u USER:VALUE``, ``-uUSER:VALUE``, ``--user USER:VALUE`` (and the proxy's ``-U`` /
   ``--proxy-user``) in the command of a client of :data:`USER_PASSWORD_CLIENTS`
   (``curl``): the part after the first ``:`` (``curl -u alice:***``; ``-u alice`` prompts
   and stays).
8. ``response=VALUE`` when VALUE (quoted or not) is 32, 40, 64 or 128 hex digits: the
   request digest of HTTP Digest authentication (``response="***"``).
9. A Weights & Biases API key, 40 hex digits (``local-`` in front for a local server), after
   the name ``WANDB_API_KEY`` with only quotes, brackets, blanks or ``=``/``:`` between
   (``os.environ["WANDB_API_KEY"] = "***"``, ``WANDB_API_KEY ***``) or in the command
   ``wandb login ...`` / the call ``wandb.login(...)``.  Other 40-hex strings (git commits,
   SHA-1 sums) stay.

Names containing ``authorization`` keep a scheme word of :data:`AUTH_SCHEMES` in
front of the masked credentials (``Authorization: Basic ***``, ``token ***``),
whatever the credentials look like; a value that is one plain word of letters under
20 characters is no credential (``authorization: required`` stays), and Digest's
parameters stay but for its ``response`` (rule 8).  In the ``name: VALUE`` form, names
containing ``cookie`` (``Cookie:``, ``Set-Cookie:``) mask the rest of the line, every
``;``-separated pair of it.

In all of these, values that are empty or exactly ``true``/``false``/
``none``/``null`` (any case) are left alone (``use_auth_token=True`` stays), in
line with ``outbound`` keeping ``None``/``bool`` under a secret key.

Independently of any name, the values of :data:`TOKEN_PATTERNS` (a table:
name, regex) are replaced by ``***`` wherever they appear, also glued to a
word in front (``shard_ghp_...``, ``load_hf_...``; OpenAI's ``sk-`` glued to a
word only as a whole key, so ``mask-rcnn_r50_fpn_coco`` stays): AWS access key ids (``AKIA``/``ASIA`` + 16 upper-case alnum), GCP API
keys (``AIza`` + 35 chars), Google OAuth tokens (``ya29.`` + 8 or more
chars), Hugging Face tokens (``hf_`` + 30 or more alnum), GitHub tokens
(``ghp_``/``gho_``/``ghu_``/``ghs_``/``ghr_`` + 20 or more alnum,
``github_pat_`` + 20 or more), Slack tokens (``xoxa-``/``xoxb-``/``xoxp-``/
``xoxr-``/``xoxs-`` + 10 or more), GitLab (``glpat-`` and its siblings + 20
or more), OpenAI (``sk-``, ``sk-proj-`` ... + 20 or more), Stripe
(``sk_live_``/``rk_test_`` ...), SendGrid (``SG.x.y``), npm (``npm_`` + 36 or
more), PyPI (``pypi-AgE...``), JWTs (``eyJ...`` . ``eyJ...`` . signature),
``Bearer <token>`` and ``Basic <credentials>`` (token of 8 or more
chars that is not a plain word: it contains a digit or one of ``-._~+/=``, or
is at least 20 chars long), the body of private key blocks
(``-----BEGIN ... PRIVATE KEY-----`` ... ``-----END ... PRIVATE KEY-----``; an
unterminated block is redacted to the end of the text), and the password in
URL credentials (``scheme://user:pw@host`` -> ``scheme://user:***@host``; the
password may hold raw ``/`` and ``@``: it ends at the last ``@`` of the URL followed by a
host and the end of the authority, so an ``@`` later in the path is masked with it
rather than a password cut short; at most 5 digits followed by ``/``, ``?`` or
``#`` are a port, not a password: ``http://host:8080/x@y.z`` stays).

Nothing else is changed: text without any of the above is returned
byte-identical.  A key form only looks at (and consumes) the value after a
secret name, so a non-secret ``x='... --password=S'`` cannot hide a secret.
The passes are repeated (at most 4 more times; clean text takes one pass)
until the text is stable, so ``redact(redact(x)) == redact(x)``.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Iterator, Sequence

__all__ = [
    "AUTH_SCHEMES",
    "MASK",
    "OPTION_ONLY_NAMES",
    "PASSWORD_P_CLIENTS",
    "PASS_NOT_PASSWORD",
    "SECRET_NAMES",
    "SECRET_SUFFIXES",
    "SECRET_WORDS",
    "TOKEN_PATTERNS",
    "USER_PASSWORD_CLIENTS",
    "is_secret_name",
    "outbound",
    "redact",
    "redact_argv",
    "warn",
]

MASK = "***"

SECRET_WORDS: tuple[str, ...] = (
    "token",
    "secret",
    "password",
    "passwd",
    "api_key",
    "apikey",
    "api-key",
    "credential",
    "passphrase",
    "signature",  # X-Amz-Signature, X-Goog-Signature
    "cookie",  # Cookie, Set-Cookie, --cookie
    "authorization",  # Authorization, Proxy-Authorization (the scheme word stays visible)
)
# Names that are secret only on their own (as substrings they are everywhere: "compass", "keyboard", "author").
# AccountKey and SharedAccessKey are the keys of Azure connection strings ("...;AccountKey=...;").
SECRET_NAMES = frozenset(
    {"pass", "pw", "pwd", "key", "auth", "sig", "accountkey", "account_key", "sharedaccesskey", "shared_access_key"}
)
# ... and of those, names that are secret only as options (--key, --auth): "key=" and "key:" are
# S3 object keys, Hive partitions and dict keys far more often than credentials.
OPTION_ONLY_NAMES = frozenset({"key", "auth"})
# Name endings that are secret after a separator: db_pass, MYSQL_ROOT_PASS, redis.pass ("bypass" is not),
# AZURE_STORAGE_ACCOUNT_KEY.
SECRET_SUFFIXES: tuple[str, ...] = ("_pass", "_account_key")
# ... but a pass through the data or the network, not a password: forward_pass, first_pass, num_pass.
PASS_NOT_PASSWORD: frozenset[str] = frozenset(
    {
        "forward",
        "backward",
        "first",
        "second",
        "third",
        "last",
        "final",
        "next",
        "single",
        "multi",
        "double",
        "one",
        "two",
        "each",
        "full",
        "fast",
        "warmup",
        "num",
        "n",
    }
)
# Command-line clients whose "-p" option carries the password itself ("mysql -uroot -pS3cret",
# "mysqldump -p S3cret db"); the command word may carry a path ("/usr/bin/mysql").
PASSWORD_P_CLIENTS: tuple[str, ...] = (
    "mysql",
    "mysqldump",
    "mysqladmin",
    "mysqlimport",
    "mysqlcheck",
    "mysqlshow",
    "mysqlpump",
    "mysqlslap",
    "mysqlbinlog",
    "mysqlsh",
    "mariadb",
    "mariadb-dump",
    "mariadb-admin",
    "mariadb-import",
    "mariadb-check",
    "mariadb-show",
    "mariadb-slap",
    "mariadb-binlog",
    "mariadb-backup",
    "mariabackup",
)
# Clients whose -u/--user (and -U/--proxy-user) option carries "user:password" ("curl -u alice:pw").
USER_PASSWORD_CLIENTS: tuple[str, ...] = ("curl",)
# Authorization schemes kept visible in front of the masked credentials ("Authorization: Basic ***").
AUTH_SCHEMES: tuple[str, ...] = (
    "basic",
    "bearer",
    "token",
    "digest",
    "negotiate",
    "ntlm",
    "hoba",
    "mutual",
    "vapid",
    "scram-sha-1",
    "scram-sha-256",
    "aws4-hmac-sha256",
    "apikey",
    "key",
    "oauth",
    "dpop",
    "gnap",
    "privatetoken",
    "sso",
)

_EXEMPT_VALUES = frozenset({"", "true", "false", "none", "null"})

# --- building blocks -------------------------------------------------------

_NAME = r"[\w.-]+"
_DQ = r'"(?:[^"\\\n]|\\.)*"?'
_SQ = r"'(?:[^'\\\n]|\\.)*'?"
# Unquoted value after '=' (or after '"key":'): stops at blanks and separators.
_BARE = r"""[^\s&,;'"()\[\]{}<>][^\s&,;'")\]}]*"""
# Unquoted value after a line-start 'key:': rest of the line (trailing blanks
# trimmed) up to a separator.
_BARE_LINE = r"""[^\s,;'"()\[\]{}<>](?:[^\n,;}\]]*[^\s,;}\]])?"""

_PRIVATE_KEY_RE = re.compile(
    r"(-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----)"
    r"(.*?)"
    r"(-----END [A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----|\Z)",
    re.S,
)
# The password may hold raw "/" and "@" (they should be percent-encoded, people paste them as
# they are): it ends at the first "@" followed by a host and the end of the authority.
# A "password" of at most 5 digits followed by "/", "?" or "#" is a port and a path
# ("http://host:8080/x@y.z"), not credentials.
# The last such "@" of the URL is taken (greedy): a password holding "@" and then "/" ("p@ss/w0rd")
# is masked whole, never cut at the "@" that a "host" ("ss") and a "/" happen to follow.
_URL_CRED_RE = re.compile(
    r"(://[^\s/:@]*:)(?![0-9]{0,5}[/?#])((?:(?!://)[^\s]){1,256})(@)(?=[A-Za-z0-9.\[\]_-]+(?::[0-9]*)?(?:[/?#\s'\")\]},;]|\Z))"
)
# Each key form is a cheap "head" (name + separator) and a value pattern that is
# only tried, and only consumed, when the name is a secret name.  A non-secret
# head never swallows the text after it, so ``x='... --password=S'`` is still
# redacted and a second pass finds nothing new (idempotence).
_VALUE_RE = re.compile(_DQ + "|" + _SQ + "|" + _BARE)
_LINE_VALUE_RE = re.compile(_DQ + "|" + _SQ + "|" + _BARE_LINE)
# An option's value may start with "-" ("--password -x9"); only a long option ("--epochs") is the next option.
# An unquoted one runs to the next blank; a quote inside it is part of it unless a blank, a
# separator or the end follows ('"--password x",' in source: the value is x).
_ARG_BARE = r"""[^\s'"](?:[^\s'"]|['"](?![\s,;)\]}]|\Z))*"""
_ARG_VALUE_RE = re.compile(_DQ + "|" + _SQ + r"|(?!--[A-Za-z])(?!-[ \t\n]|-\Z)" + _ARG_BARE)
# Authorization: an optional scheme word (kept) and the credentials.
_AUTH_SCHEME_RE = re.compile(r"(?i:" + "|".join(re.escape(s) for s in AUTH_SCHEMES) + r")[ \t]+(?=\S)")
_PARAM_RE = re.compile(r"[\w-]+=")
_AUTH_VALUE_RE = re.compile(_DQ + "|" + _SQ + r"|(?:" + _AUTH_SCHEME_RE.pattern + ")?" + _BARE)
# Cookie: / Set-Cookie: as a header line: every pair of the list, to the end of the line (or quote).
_COOKIE_LINE_VALUE_RE = re.compile(_DQ + "|" + _SQ + r"""|[^\s'"<](?:[^\n'"]*[^\s'"])?""")
# "mysql ... -pS3cret" / "mysql ... -p S3cret": a client word, then its command up to ; | & or a newline.
_P_CLIENT_RE = re.compile(
    r"(?<![\w.-])(?:"
    + "|".join(re.escape(c) for c in sorted(PASSWORD_P_CLIENTS, key=len, reverse=True))
    + r")(?![\w.-])"
)
_COMMAND_END_RE = re.compile(r"[;|&\n]")
# "curl -u alice:pw", "curl -ualice:pw", "curl --user alice:pw" (and the proxy's -U/--proxy-user):
# the part after the first ":" is the password ("curl -u alice" prompts for it: nothing to mask)
_U_CLIENT_RE = re.compile(
    r"(?<![\w.-])(?:" + "|".join(re.escape(c) for c in USER_PASSWORD_CLIENTS) + r")(?:\.exe)?(?![\w.-])"
)
_U_OPTION_RE = re.compile(
    r"""(?<![^\s'"])(?:-[uU][ \t]*|--(?:proxy-)?user(?:[ \t]+|=))(?P<v>""" + _DQ + "|" + _SQ + r"""|[^\s'"]\S*)"""
)
# "sshpass -p pw ssh host": only sshpass's own options, up to the command it runs (whose -p is a port)
_SSHPASS_RE = re.compile(r"(?<![\w.-])sshpass(?![\w.-])")
_WORD_RE = re.compile(_DQ + "|" + _SQ + r"|[^\s'\"]\S*|\S")
# HTTP Digest: response="<hex digest>" (32, 40, 64 or 128 hex digits: MD5, SHA-1, SHA-256, SHA-512)
_DIGEST_RESPONSE_RE = re.compile(
    r"(?<![\w.-])(?i:response)[ \t]*=[ \t]*(?P<q>\\{0,4}[\"']?)(?P<v>[0-9a-fA-F]{32}(?:[0-9a-fA-F]{8}|[0-9a-fA-F]{32}|[0-9a-fA-F]{96})?)(?![0-9A-Za-z])"
)
# A Weights & Biases API key: 40 hex digits (a local server's with "local-" in front), recognised where
# it follows the name WANDB_API_KEY (any quotes, brackets or blanks between) or in `wandb login` /
# `wandb.login(...)`; elsewhere 40 hex digits are a git commit or a SHA-1 and stay.
_WANDB_KEY = r"(?:local-)?[0-9a-fA-F]{40}(?![0-9A-Za-z_-])"
_WANDB_AFTER_NAME_RE = re.compile(r"(?i:wandb_api_key)(?P<sep>[^\w\n]{1,16}?)(?<![0-9A-Za-z_-])" + _WANDB_KEY)
_WANDB_LOGIN_RE = re.compile(r"(?<![\w.-])wandb(?:[ \t]+login(?![\w.-])|\.login[ \t]*\()")
_WANDB_KEY_RE = re.compile(r"(?<![0-9A-Za-z_-])" + _WANDB_KEY)
_LOGIN_END_RE = re.compile(r"[;|&\n)]")
_P_OPTION_RE = re.compile(
    r"""(?<![^\s'"])-p(?:(?P<glued>"""
    + _DQ
    + "|"
    + _SQ
    + "|"
    + _ARG_BARE
    + r""")|[ \t]+(?P<spaced>"""
    + _DQ
    + "|"
    + _SQ
    + r"|(?!-)"
    + _ARG_BARE
    + "))"
)
_AWS_SECRET_VALUE_RE = re.compile(r"""["']?(?P<v>[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])""")

_QUOTED_KEY_HEAD_RE = re.compile(r"""(?<![\w*"'])(?P<q>["'])(?P<name>""" + _NAME + r""")(?P=q)\s*:\s*""")
_COLON_KEY_HEAD_RE = re.compile(
    r"""(?:^|(?<=[{,;(\["'\s]))[ \t]*(?:-[ \t]+)?(?P<name>""" + _NAME + r")[ \t]*:[ \t]*", re.M
)
_EQ_KEY_HEAD_RE = re.compile(r"(?<![\w.-])(?P<name>" + _NAME + r")(?:=|[ \t]+=(?!=)[ \t]*)(?!=)")
# The option starts the text or follows a blank, a quote, "(", "[", "," or "=" ('"--password x"' in source).
_SPACED_OPT_HEAD_RE = re.compile(r"""(?<![^\s"'(\[,=])(?P<name>--?""" + _NAME + r")[ \t]+")
_AWS_SECRET_HEAD_RE = re.compile(r"(?<![\w.-])(?P<name>" + _NAME + r")[ \t]*[=:][ \t]*")
_EXCEPTION_NAME_RE = re.compile(r"(?:Error|Exception|Warning)\Z")

# Values that are secrets whatever name they follow: (name, pattern) as data, so adding one is one line.
# Shapes follow the issuers' documented formats (and detect-secrets' plugins, which the tests use
# as an independent check).
TOKEN_PATTERNS: tuple[tuple[str, str], ...] = (
    # No word boundary is required in front: a token glued to an identifier ("shard_ghp_...",
    # "load_hf_...", "DS_ghp_...") is still a token.  The prefixes are distinctive and the bodies
    # long, so ordinary identifiers do not match.
    ("aws-access-key-id", r"(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])"),
    ("gcp-api-key", r"AIza[0-9A-Za-z_-]{35}(?![0-9A-Za-z_-])"),
    ("google-oauth", r"ya29\.[0-9A-Za-z_.-]{8,}"),
    ("huggingface", r"hf_[A-Za-z0-9]{30,}"),
    ("github", r"(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"),
    ("gitlab", r"gl(?:pat|dt|rt|ptt|cbt|oas)-[A-Za-z0-9_-]{20,}"),
    ("slack", r"xox[abprs]-[A-Za-z0-9-]{10,}"),
    ("openai", r"(?<![A-Za-z0-9_-])sk-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_]{20,}"),
    # "sk-" glued to a word ("task-", "mask-rcnn_r50_fpn_coco_2017"): only the documented key
    # shapes, whole (project/service/admin keys; or 20+ alphanumerics up to the end of the word).
    (
        "openai-glued",
        r"(?<=[A-Za-z0-9_])sk-(?:(?:proj|svcacct|admin)-[A-Za-z0-9_-]{20,}"
        r"|[A-Za-z0-9]{20,}(?![A-Za-z0-9_-]))",
    ),
    ("stripe", r"(?:sk|rk)_(?:live|test)_[0-9A-Za-z]{16,}"),
    ("sendgrid", r"SG\.[A-Za-z0-9_-]{16,}\.[A-Za-z0-9_-]{16,}"),
    ("npm", r"npm_[A-Za-z0-9]{36,}"),
    ("pypi", r"pypi-AgE[A-Za-z0-9_-]{50,}"),
    ("jwt", r"eyJ[A-Za-z0-9_-]{4,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*"),
)
_TOKEN_RES: tuple[re.Pattern[str], ...] = tuple(re.compile(rx) for _name, rx in TOKEN_PATTERNS)
_BEARER_RE = re.compile(
    r"(?<![A-Za-z0-9_])(?P<kw>[Bb]earer|BEARER|[Bb]asic|BASIC)(?P<sep>[ \t]+)(?P<value>[A-Za-z0-9\-._~+/]{8,}=*)"
)

_DQ_CLOSED_RE = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_SQ_CLOSED_RE = re.compile(r"'(?:[^'\\\n]|\\.)*'")
_LONG_OPT_RE = re.compile(r"--[A-Za-z]")
_ARGV_OPT_RE = re.compile(r"-{1,2}[\w.-]+\Z")
_ARGV_ASSIGN_RE = re.compile(r"([\w.-]+)=(.*)\Z", re.S)


def is_secret_name(name: object) -> bool:
    """True when ``name`` is a str containing one of :data:`SECRET_WORDS` (any case)."""
    if not isinstance(name, str):
        return False
    low = name.lower()
    if any(w in low for w in SECRET_WORDS):
        return True
    bare = low.lstrip("-")
    norm = bare.replace("-", "_")
    dotted = norm.replace(".", "_")
    if dotted.endswith(SECRET_SUFFIXES):
        return not (dotted.endswith("_pass") and dotted[: -len("_pass")].rsplit("_", 1)[-1] in PASS_NOT_PASSWORD)
    return norm in SECRET_NAMES and (bare != low or norm not in OPTION_ONLY_NAMES)


def _is_exempt(value: str) -> bool:
    v = value
    if v[:1] in ("'", '"'):
        v = v[1:]
        if v[-1:] == value[:1]:
            v = v[:-1]
    return v.lower() in _EXEMPT_VALUES


def _mask_value(value: str) -> str:
    """``***`` keeping surrounding quotes (a lone opening quote is kept too)."""
    q = value[:1]
    if q in ("'", '"'):
        closed = (_DQ_CLOSED_RE if q == '"' else _SQ_CLOSED_RE).fullmatch(value) is not None
        return q + MASK + (q if closed else "")
    return MASK


def _is_yaml_key_name(name: str) -> bool:
    # "tokenize.TokenError: ..." in a traceback is an exception, not a key.
    return is_secret_name(name) and not _EXCEPTION_NAME_RE.search(name)


def _mask_aws(v: re.Match[str]) -> str:
    return v.group(0)[: v.start("v") - v.start(0)] + MASK


def _mask_arg(v: re.Match[str]) -> str:
    return _mask_arg_text(v.group(0))


def _mask_arg_text(value: str) -> str:
    """An option's value; closing punctuation glued to an unquoted one stays ("--password x)," -> "***),")."""
    if value[:1] in ("'", '"'):
        return _mask_value(value)
    core = value.rstrip(",;)]}")
    return MASK + value[len(core) :] if core else value


def _mask_auth(v: re.Match[str]) -> str:
    """Authorization credentials; the scheme word stays visible ("Basic ***", '"Bearer ***"')."""
    value = v.group(0)
    q = value[:1] if value[:1] in ("'", '"') else ""
    inner = value[1:] if q else value
    m = _AUTH_SCHEME_RE.match(inner)
    if m is None:
        bare = inner[:-1] if q and inner.endswith(q) else inner
        if inner.lower() in AUTH_SCHEMES or (bare.isalpha() and len(bare) < 20):  # "authorization: required"
            return value
        return _mask_value(value)
    rest = inner[m.end() :]
    if rest[:1] == "<":  # "Bearer <token>": a placeholder
        return value
    if m.group(0).rstrip().lower() == "digest" and _PARAM_RE.match(rest):
        return value  # Digest's parameters (username, realm, uri...) are not secret; its response is masked alone
    closed = bool(q) and (_DQ_CLOSED_RE if q == '"' else _SQ_CLOSED_RE).fullmatch(value) is not None
    return q + inner[: m.end()] + MASK + (q if closed else "")


_Pick = Callable[[str], "tuple[re.Pattern[str], Callable[[re.Match[str]], str]] | None"]


def _form(
    value_rx: re.Pattern[str],
    masker: Callable[[re.Match[str]], str],
    name_ok: Callable[[str], bool] = is_secret_name,
    cookie_rx: re.Pattern[str] | None = None,
) -> _Pick:
    """What a key form masks after a name: None for a name that is not secret; Authorization
    names get their scheme-aware value, Cookie names ``cookie_rx`` where given (the header line)."""

    def pick(name: str) -> tuple[re.Pattern[str], Callable[[re.Match[str]], str]] | None:
        if not name_ok(name):
            return None
        low = name.lower()
        if "authorization" in low:
            return _AUTH_VALUE_RE, _mask_auth
        if cookie_rx is not None and "cookie" in low:
            return cookie_rx, masker
        return value_rx, masker

    return pick


def _scan(text: str, head_rx: re.Pattern[str], pick: _Pick) -> str:
    """Mask the value after every head whose name ``pick`` gives a value form for.

    Linear: heads are found left to right; a value is scanned only after a
    secret name and is then either consumed (masked) or a short exempt literal.
    """
    out: list[str] = []
    last = pos = 0
    n = len(text)
    while pos <= n:
        m = head_rx.search(text, pos)
        if m is None:
            break
        end = m.end()
        pos = end if end > m.start() else end + 1
        form = pick(m.group("name"))
        if form is None:
            continue
        value_rx, masker = form
        v = value_rx.match(text, end)
        if v is None or _is_exempt(v.group(0)):
            continue
        out.append(text[last:end])
        out.append(masker(v))
        last = pos = v.end()
    if not out:
        return text
    out.append(text[last:])
    return "".join(out)


def _mask_match(v: re.Match[str]) -> str:
    return _mask_value(v.group(0))


_QUOTED_FORM = _form(_VALUE_RE, _mask_match)
_COLON_FORM = _form(_LINE_VALUE_RE, _mask_match, _is_yaml_key_name, cookie_rx=_COOKIE_LINE_VALUE_RE)
_EQ_FORM = _form(_VALUE_RE, _mask_match)
_OPTION_FORM = _form(_ARG_VALUE_RE, _mask_arg)
_AWS_FORM = _form(_AWS_SECRET_VALUE_RE, _mask_aws)


def _mask_p_options(text: str) -> str:
    """The password of ``-pS3cret`` / ``-p S3cret`` in the command of a client of PASSWORD_P_CLIENTS.

    Linear: each command (a client word up to ; | & or a newline) is scanned once."""
    out: list[str] = []
    last = pos = 0
    while True:
        c = _P_CLIENT_RE.search(text, pos)
        if c is None:
            break
        e = _COMMAND_END_RE.search(text, c.end())
        stop = e.start() if e is not None else len(text)
        for m in _P_OPTION_RE.finditer(text, c.end(), stop):
            group = "glued" if m.group("glued") is not None else "spaced"
            value = m.group(group)
            if _is_exempt(value):
                continue
            start, end = m.span(group)
            out.append(text[last:start])
            out.append(_mask_arg_text(value))
            last = end
        pos = stop + 1 if e is not None else len(text) + 1
        if pos > len(text):
            break
    if not out:
        return text
    out.append(text[last:])
    return "".join(out)


def _commands(
    text: str, client_rx: re.Pattern[str], end_rx: re.Pattern[str] = _COMMAND_END_RE
) -> Iterator[tuple[int, int]]:
    """(start, stop) of each command of a client: from after its word to ; | & or a newline (linear)."""
    pos = 0
    while True:
        c = client_rx.search(text, pos)
        if c is None:
            return
        e = end_rx.search(text, c.end())
        stop = e.start() if e is not None else len(text)
        yield c.end(), stop
        pos = stop + 1 if e is not None else len(text) + 1
        if pos > len(text):
            return


def _splice(text: str, spans: list[tuple[int, int, str]]) -> str:
    """``text`` with each (start, end) replaced, spans in order and not overlapping."""
    if not spans:
        return text
    out: list[str] = []
    last = 0
    for start, end, new in spans:
        out.append(text[last:start])
        out.append(new)
        last = end
    out.append(text[last:])
    return "".join(out)


def _after_colon(value: str) -> str | None:
    """'alice:pw' -> 'alice:***' (quotes kept); None where there is no password to mask."""
    q = value[:1] if value[:1] in ("'", '"') else ""
    inner = value[1:] if q else value
    closed = bool(q) and inner.endswith(q)
    if closed:
        inner = inner[:-1]
    user, colon, password = inner.partition(":")
    if not colon or not password or _is_exempt(password):
        return None
    return q + user + ":" + MASK + (q if closed else "")


def _mask_u_options(text: str) -> str:
    """The password of ``-u user:pw`` / ``--user user:pw`` in the command of a USER_PASSWORD_CLIENTS client."""
    spans: list[tuple[int, int, str]] = []
    for start, stop in _commands(text, _U_CLIENT_RE):
        for m in _U_OPTION_RE.finditer(text, start, stop):
            masked = _after_colon(m.group("v"))
            if masked is not None:
                spans.append((m.start("v"), m.end("v"), masked))
    return _splice(text, spans)


def _mask_sshpass(text: str) -> str:
    """``sshpass -p pw`` / ``-ppw``: sshpass's options end at the command it runs (``ssh -p 22`` is a port)."""
    spans: list[tuple[int, int, str]] = []
    stop = -1
    for c in _SSHPASS_RE.finditer(text):  # each sshpass, also a second one before the command ends
        if c.end() > stop:  # (sshpass words of one command share its end: one search each command)
            e = _COMMAND_END_RE.search(text, c.end())
            stop = e.start() if e is not None else len(text)
        start = c.end()
        skip = False
        for w in _WORD_RE.finditer(text, start, stop):
            word = w.group(0)
            if skip:  # the value of -f, -d or -P
                skip = False
                continue
            if not word.startswith("-"):
                break  # the command sshpass runs
            if word == "-p":
                v = _WORD_RE.search(text, w.end(), stop)
                if v is not None and not _is_exempt(v.group(0)):
                    spans.append((v.start(), v.end(), _mask_arg_text(v.group(0))))
                break
            if word.startswith("-p"):
                if not _is_exempt(word[2:]):
                    spans.append((w.start() + 2, w.end(), _mask_arg_text(word[2:])))
                break
            skip = word in ("-f", "-d", "-P")
    return _splice(text, spans)


def _mask_wandb(text: str) -> str:
    """A W&B API key after the name WANDB_API_KEY, and in ``wandb login ...`` / ``wandb.login(...)``."""
    if "wandb" not in text.lower():
        return text
    text = _WANDB_AFTER_NAME_RE.sub(lambda m: m.group(0)[: m.end("sep") - m.start(0)] + MASK, text)
    spans: list[tuple[int, int, str]] = []
    for start, stop in _commands(text, _WANDB_LOGIN_RE, _LOGIN_END_RE):
        spans.extend((k.start(), k.end(), MASK) for k in _WANDB_KEY_RE.finditer(text, start, stop))
    return _splice(text, spans)


def _sub_digest(m: re.Match[str]) -> str:
    return m.group(0)[: m.start("v") - m.start(0)] + MASK


def _sub_bearer(m: re.Match[str]) -> str:
    value = m.group("value")
    if value.isalpha() and len(value) < 20:  # "the bearer ofsomething" prose
        return m.group(0)
    return m.group("kw") + m.group("sep") + MASK


def _sub_url(m: re.Match[str]) -> str:
    return m.group(1) + MASK + m.group(3)


# A line break written as an escape ("\\n" in a repr, a JSON string or a log line of them): the text after
# it starts a line as much as after a real one (a client word, "--password" at the start of the line).
_ESCAPED_BREAK_RE = re.compile(r"(\\+[nrt])")


def _redact(text: str) -> str:
    text = _redact_text(text)
    if "\\" in text and _ESCAPED_BREAK_RE.search(text):
        # the rules again on each escaped line: the whole text first (a quoted value holding an escape is
        # masked whole), then line by line for what only a line start shows
        parts = _ESCAPED_BREAK_RE.split(text)
        text = "".join(part if i % 2 else _redact_text(part) for i, part in enumerate(parts))
    return text


def _redact_text(text: str) -> str:
    if "PRIVATE KEY" in text:
        text = _PRIVATE_KEY_RE.sub(lambda m: m.group(1) + MASK + m.group(3), text)
    if "://" in text:
        text = _URL_CRED_RE.sub(_sub_url, text)
    if ":" in text:
        text = _scan(text, _QUOTED_KEY_HEAD_RE, _QUOTED_FORM)
        text = _scan(text, _COLON_KEY_HEAD_RE, _COLON_FORM)
    if "=" in text:
        text = _scan(text, _EQ_KEY_HEAD_RE, _EQ_FORM)
    if "-" in text:
        text = _scan(text, _SPACED_OPT_HEAD_RE, _OPTION_FORM)
        text = _mask_p_options(text)
        text = _mask_u_options(text)
        text = _mask_sshpass(text)
    if "=" in text:
        text = _DIGEST_RESPONSE_RE.sub(_sub_digest, text)
    text = _mask_wandb(text)
    if "=" in text or ":" in text:
        text = _scan(text, _AWS_SECRET_HEAD_RE, _AWS_FORM)
    for rx in _TOKEN_RES:
        text = rx.sub(MASK, text)
    text = _BEARER_RE.sub(_sub_bearer, text)
    if "://" in text:
        # Again: masking a value above can remove the "/" or blank that used to
        # end a URL's userinfo; without this pass redact() would not be idempotent.
        text = _URL_CRED_RE.sub(_sub_url, text)
    return text


_MAX_PASSES = 4


# Nothing above can match a text in which none of these occurs (case-folded): a secret word or
# name (every key form needs one), "://", a private key header, a token prefix, bearer/basic.
# One search instead of a dozen passes: most of what dlwatch writes (samples, fd names) is clean.
_GATE_RE = re.compile(
    "|".join(re.escape(w) for w in (*SECRET_WORDS, *SECRET_NAMES))
    + r"|://|private key|akia|asia|aiza|ya29\.|hf_|gh[pousr]_|github_pat_|gl[a-z]{1,4}-|xox[abprs]-"
    + r"|sk-|[sr]k_|sg\.|npm_|pypi-|eyj|bearer|basic|mysql|maria|curl|response|wandb"
)


def _redact_to_fixpoint(text: str) -> str:
    """``_redact`` until the text stops changing (at most _MAX_PASSES more passes).

    Masking can change what a later pass sees (quote pairing, a removed "/" ending a URL's
    userinfo); repeating until stable makes redact(redact(x)) == redact(x).  Clean text takes
    a single pass."""
    prev, cur = text, _redact(text)
    for _ in range(_MAX_PASSES):
        if cur == prev:
            break
        prev, cur = cur, _redact(cur)
    return cur


def redact(text: str) -> str:
    """Return ``text`` with secret-looking values replaced by ``***``.

    Non-``str`` input is returned unchanged; never raises.  See the module
    docstring for the exact rules.
    """
    if not isinstance(text, str):
        return text
    try:
        if _GATE_RE.search(text.lower()) is None:
            return text
        return _redact_to_fixpoint(text)
    except Exception:  # pragma: no cover - defensive: never leak, never raise
        return MASK


def redact_argv(argv: Sequence[str]) -> list[str]:
    """Redact a command line given as a list of arguments.

    * ``--secret-name VALUE`` (two elements): VALUE becomes ``***`` unless it
      starts with ``-`` (then it is the next option) or is empty / a
      true/false/none/null literal.
    * ``--secret-name=VALUE`` and ``SECRET_NAME=VALUE`` (one element): everything
      after the first ``=`` becomes ``***`` (same exemptions).
    * the command-bound forms of :func:`redact` across elements: ``-p PW`` / ``-pPW`` of a
      :data:`PASSWORD_P_CLIENTS` client and of ``sshpass`` (its own options only),
      ``-u USER:PW`` / ``--user USER:PW`` of a :data:`USER_PASSWORD_CLIENTS` client, a W&B key
      in ``wandb login``; the command ends at an element ``;``, ``|``, ``&&`` ...
    * every other element goes through :func:`redact` (positional tokens,
      URL credentials, ...).

    A ``str`` is treated as a one-element command line; non-``str`` elements
    are kept as they are; an argument that is not iterable gives ``[]``.
    """
    try:
        items = [argv] if isinstance(argv, str) else list(argv)
    except Exception:
        return []
    out: list[Any] = []
    mask_next = False
    command = ""  # the client whose options are being read: "p", "sshpass", "user", "wandb", "wandb login"
    pending = ""  # what the previous element asked of this one: "mask", "after-colon", "skip"
    for item in items:
        try:
            if not isinstance(item, str):
                out.append(item)
                mask_next = False
                command = pending = ""
                continue
            masked, command, pending = _argv_command(item, command, pending)
            if masked is not None:
                out.append(masked)
                mask_next = False
                continue
            if mask_next and not _LONG_OPT_RE.match(item):
                out.append(item if _is_exempt(item) else MASK)
                mask_next = False
                continue
            mask_next = False
            if _ARGV_OPT_RE.match(item):
                mask_next = is_secret_name(item)
                out.append(item)
                continue
            m = _ARGV_ASSIGN_RE.match(item)
            if m and is_secret_name(m.group(1)) and not _is_exempt(m.group(2)):
                out.append(m.group(1) + "=" + MASK)
                continue
            out.append(redact(item))
        except Exception:  # pragma: no cover - defensive
            out.append(MASK)
    return out


_ARGV_SEPARATORS = frozenset({";", "|", "||", "&", "&&"})


def _argv_command(item: str, command: str, pending: str) -> tuple[str | None, str, str]:
    """One element of a command line in the command it belongs to: (the element masked, or None to
    leave it to the other rules; the command now; what the next element is)."""
    if pending == "mask":
        return (item if _is_exempt(item) or item.startswith("--") else MASK), command, ""
    if pending == "after-colon":
        return _after_colon(item) or item, command, ""
    if pending == "skip":
        return item, command, ""
    if item in _ARGV_SEPARATORS:
        return None, "", ""
    if command == "wandb key":  # WANDB_API_KEY in an element before: the key may follow after "=" or quotes
        core = item.strip("'\"[](){}=:,; ")
        if not core:
            return None, command, ""
        if _WANDB_KEY_RE.fullmatch(core):
            return item.replace(core, MASK), "", ""
        command = ""
    if "wandb_api_key" in item.lower() and not _WANDB_KEY_RE.search(item):
        return None, "wandb key", ""
    word = item.rsplit("/", 1)[-1]
    if word in PASSWORD_P_CLIENTS:
        return None, "p", ""
    if word == "sshpass":
        return None, "sshpass", ""
    if word in USER_PASSWORD_CLIENTS or word.removesuffix(".exe") in USER_PASSWORD_CLIENTS:
        return None, "user", ""
    if word == "wandb":
        return None, "wandb", ""
    if command == "wandb":
        return None, ("wandb login" if item == "login" else ""), ""
    if command == "wandb login":
        return (MASK if _WANDB_KEY_RE.fullmatch(item) else None), command, ""
    if command in ("p", "sshpass") and item.startswith("-p"):
        if item == "-p":
            return None, command, "mask"
        return ("-p" + (item[2:] if _is_exempt(item[2:]) else MASK)), command, ""
    if command == "sshpass":
        if item in ("-f", "-d", "-P"):
            return None, command, "skip"
        return None, (command if item.startswith("-") else ""), ""  # the command sshpass runs begins
    if command == "user":
        if item in ("-u", "-U", "--user", "--proxy-user"):
            return None, command, "after-colon"
        for opt in ("--user=", "--proxy-user=", "-u", "-U"):
            if item.startswith(opt) and len(item) > len(opt):
                masked = _after_colon(item[len(opt) :])
                return (item[: len(opt)] + masked if masked else None), command, ""
    return None, command, ""


_MAX_DEPTH = 200


def _to_text(obj: Any) -> str:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj).decode("utf-8", "surrogateescape")
    if isinstance(obj, BaseException):
        return f"{type(obj).__name__}: {obj}"
    try:
        return str(obj)
    except Exception:
        return f"<{type(obj).__name__}>"


_KEY_CACHE: dict[Any, tuple[Any, bool]] = {}  # the same few dozen keys, every poll


def _outbound_key(k: Any) -> tuple[Any, bool]:
    """(the key as written, whether it names a secret); str keys are cached."""
    if k is None or isinstance(k, (bool, int, float)):
        return k, False
    if type(k) is str:
        hit = _KEY_CACHE.get(k)
        if hit is not None:
            return hit
    key = redact(_to_text(k))
    out = (key, is_secret_name(key))
    if type(k) is str:
        if len(_KEY_CACHE) >= 4096:
            _KEY_CACHE.clear()
        _KEY_CACHE[k] = out
    return out


_PLAIN = frozenset({type(None), bool, int, float})
_TEXT_CACHE: dict[str, str] = {}  # process names, states, fd targets: the same strings every poll


def _outbound_text(text: str) -> str:
    if len(text) > 256:
        return redact(text)
    hit = _TEXT_CACHE.get(text)
    if hit is None:
        hit = redact(text)
        if len(_TEXT_CACHE) >= 4096:
            _TEXT_CACHE.clear()
        _TEXT_CACHE[text] = hit
    return hit


def _outbound(obj: Any, depth: int, active: set[int]) -> Any:
    t = type(obj)
    if t in _PLAIN:
        return obj
    if t is str:
        return _outbound_text(obj)
    if isinstance(obj, BaseException):  # the message on its own, so that its line-start forms are seen
        return f"{type(obj).__name__}: {redact(_to_text(str(obj)))}"
    if isinstance(obj, (bool, int, float)):  # subclasses (IntEnum, numpy scalars that subclass float)
        return obj
    if isinstance(obj, str):
        return redact(str(obj))
    if not isinstance(obj, (dict, list, tuple, set, frozenset)):
        return redact(_to_text(obj))  # converted first, redacted after: bytes and any other object
    if depth > _MAX_DEPTH:
        return MASK
    oid = id(obj)
    if oid in active:
        return "<cycle>"
    active.add(oid)
    try:
        if isinstance(obj, dict):
            out: dict[Any, Any] = {}
            for k, v in obj.items():
                key, secret = _outbound_key(k)
                tv = type(v)
                if secret and not (v is None or tv is bool or (tv is str and v == "")):
                    out[key] = MASK
                elif tv in _PLAIN:
                    out[key] = v
                elif tv is str:
                    out[key] = _outbound_text(v)
                else:
                    out[key] = _outbound(v, depth + 1, active)
            return out
        return [_outbound(v, depth + 1, active) for v in obj]
    finally:
        active.discard(oid)


def outbound(obj: Any) -> Any:
    """The one redaction point: everything dlwatch writes to a file or prints passes through here.

    Returns plain JSON-ready data: ``str`` redacted; dicts with their keys redacted too
    (a key that is a secret name masks its value); lists, tuples and sets as lists;
    ``bytes``, exceptions and any other object converted to text *before* redaction
    (``json.dumps(default=str)`` would otherwise convert them after it).  Numbers,
    bools and None are kept.  Never raises.
    """
    try:
        return _outbound(obj, 0, set())
    except Exception:  # pragma: no cover - defensive: never leak, never raise
        return MASK


def outbound_text(text: str) -> str:
    """``outbound`` of one ``str``, without the container walk: what a serialiser that already
    knows its shape calls for the fields that can hold user text (names, paths).  Recent short
    strings come from the same cache ``outbound`` uses."""
    try:
        return _outbound_text(text) if type(text) is str else outbound(text)
    except Exception:  # pragma: no cover - defensive: never leak, never raise
        return MASK


def outbound_bytes(data: bytes | str) -> bytes:
    """Text bound for a file, redacted; bytes that are not UTF-8 pass through unchanged (surrogateescape)."""
    text = _to_text(data) if not isinstance(data, str) else data
    return redact(text).encode("utf-8", "surrogateescape")


def warn(message: object, category: type[Warning], stacklevel: int = 1) -> None:
    """``warnings.warn(message, category, stacklevel)`` with ``message`` redacted first.

    Every warning dlwatch gives goes through here: its text can hold a thread name, a path or an
    exception message of the program, and Python prints it on the program's stderr.  ``stacklevel``
    counts as for ``warnings.warn`` called where this is called.
    """
    warnings.warn(outbound(_to_text(message)), category, stacklevel=stacklevel + 1)
