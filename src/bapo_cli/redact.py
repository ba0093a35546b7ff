"""Secrets stay on this machine: everything recorded or printed passes through here first.

Two kinds of secret reach a config or a command line:
- credentials in a URL: `tracking.uri=http://user:pass@host:5000` (also when it comes from
  `${oc.env:VAR}`), shown as `http://user:***@host:5000`, or `http://***@host` for a bare token;
- the value of a key whose last path component names a secret (`HF_TOKEN`, `api_key`,
  `password`, `secret`, `*_key`, `*_pass`, `*_pwd`): `+x.HF_TOKEN=abc` is shown as
  `+x.HF_TOKEN=***`. In a lower/camel-case name the rule matches whole `_`-separated words at the
  end, so `algo.low_range`, `rollout.max_tokens` or `monkey` are left alone; an env-style name
  (all upper case: `PGPASSWORD`, `MYSQL_PWD`, `GITHUBTOKEN`) matches any name ending in one of
  the words, and every value under `hydra.job.env_set` is masked whatever its name (an
  environment variable's value is where a tool's credentials usually go);
- a secret this process was handed (`remember`, `remember_overrides`): its literal text is masked
  wherever it appears, which also covers what the patterns cannot delimit (a quoted password
  with a space, `tracking.uri='http://u:p w@h'`, printed unquoted in a table or an error).

MLflow params and tags, the config.yaml artifact, `bapo config`, the plan and summary tables,
error lines and tracking warnings use these functions; the connection itself still uses the real
URI. The functions are pure and idempotent (masking twice gives the same text). Over-masking is
preferred to a leak: a URL's user info is everything up to its last `@`. Log records are masked
as they are made (`mask_log_records`): Hydra's launchers log each job's overrides as typed.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

MASK = "***"
# the last word of a secret key's name (`HF_TOKEN`, `api_key`); `max_tokens` is not one
SECRET_WORDS = (
    "token",
    "password",
    "passwd",
    "pwd",
    "pass",
    "passphrase",
    "secret",
    "key",
    "apikey",
    "credentials",
    "credential",
)
_SECRET_NAME = re.compile(rf"(?:^|[_-])(?:{'|'.join(SECRET_WORDS)})$")
# env-style names run words together (`PGPASSWORD`): any upper-case name ending in a word
_ENV_NAME = re.compile(r"^[A-Z0-9_]*[A-Z][A-Z0-9_]*$")
_ENV_SECRET = re.compile(rf"(?:{'|'.join(w.upper() for w in SECRET_WORDS)})$")
ENV_SET = "env_set"  # hydra.job.env_set.<VAR>: every value under it is masked
# a literal secret is replaced wherever it appears once it is at least this long (or holds a
# space, which no pattern can delimit); shorter ones (`test`, `2026`) would mask ordinary text,
# and are masked only where a pattern finds them (`name=value`, a URL's user info)
MIN_LITERAL = 8
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
# `http://`, `http\://` (as Hydra prints an override), or a bare `//` (OmegaConf reads
# `{http://u:p@h}` as a dict and its error quotes `'//u:p@h'`)
_SCHEME = r"(?:[A-Za-z][A-Za-z0-9+.\-]*\\?:)?//"
# a URL: its scheme, then everything up to whitespace (its user info: up to the last `@`)
_URL = re.compile(rf"(?P<scheme>{_SCHEME})(?P<rest>\S*)")
# name=value pairs (overrides, query strings); the value is quoted, or ends at whitespace or `&`
_ASSIGN = re.compile(r"""(?P<name>[\w.+~/\-]+)=(?P<value>'[^']*'|"[^"]*"|[^\s&]*)""")
_UNSET = ("", "None", "null")  # an empty secret is shown as it is: nothing is hidden there


def is_secret_name(key: str) -> bool:
    """True when the key's last component (after `.` or `/`) names a secret: `HF_TOKEN`,
    `tracking.api_key`, `apiKey`, `db_password`, `PGPASSWORD`, `MYSQL_PWD`, `DB_PASS`; or when
    the key lies under `hydra.job.env_set` (`...env_set.ANYTHING`). Not `max_tokens`,
    `low_range`, `keyboard`."""
    parts = re.split(r"[./]", key.lstrip("+~"))
    return ENV_SET in parts[:-1] or _names_secret(parts[-1])


def _names_secret(name: str) -> bool:
    if _ENV_NAME.match(name) and _ENV_SECRET.search(name):
        return True
    return bool(_SECRET_NAME.search(_CAMEL.sub("_", name).lower()))


_remembered: set[str] = set()
_remembered_lock = threading.Lock()


def remember(secret: str | None) -> None:
    """Mask this literal text wherever it appears from now on, in this process (a password
    with a space, which no pattern finds the end of). Too short or empty: ignored."""
    if not secret or secret in _UNSET or secret == MASK:
        return
    if len(secret) >= MIN_LITERAL or (len(secret) >= 3 and any(c.isspace() for c in secret)):
        with _remembered_lock:
            _remembered.add(secret)


def forget() -> None:
    """Forget every remembered literal (tests: one test's secrets must not mask the next's text)."""
    with _remembered_lock:
        _remembered.clear()


def url_secret(value: str) -> str | None:
    """The credential part of one URL (`p w` of `http://u:p w@h`, the token of `https://T@h`):
    everything between the scheme's `//` and the last `@`, after the user's `:`. None if none."""
    match = re.match(rf"\s*{_SCHEME}(?P<rest>.*)$", value, re.DOTALL)
    if match is None:
        return None
    info, at, _ = match.group("rest").rpartition("@")
    if not at or not info or "/" in info:  # `file:///a@b`: a path, not user info
        return None
    user, colon, password = info.partition(":")
    return password if colon and password else info


def remember_overrides(lines: list[str]) -> None:
    """Remember the secrets of a command line as typed: each secret-named key's value and each
    URL's credentials, quotes stripped (`tracking.uri='http://u:p w@h'` -> `p w`). A value
    under `hydra.job.env_set` whose own name is not a secret's (`TOKENIZERS_PARALLELISM=false`)
    is masked where it is assigned, not as a literal everywhere."""
    for line in lines:
        name, eq, value = line.partition("=")
        if not eq:
            continue
        for one in _split_sweep(value):
            one = one.strip()
            if len(one) >= 2 and one[0] == one[-1] and one[0] in "'\"":
                one = one[1:-1]
            if _names_secret(re.split(r"[./]", name.lstrip("+~"))[-1]):
                remember(one)
            remember(url_secret(one))


def remember_tree(node: Any, secret: bool = False) -> None:
    """Remember the secrets of a config as a container (`dataclasses.asdict`, OmegaConf's
    `to_container`): secret-named keys' values and URL credentials, resolved values included
    (`tracking.uri=${oc.env:VAR}`)."""
    if isinstance(node, dict):
        for key, value in node.items():
            remember_tree(value, secret or _names_secret(str(key)))
    elif isinstance(node, list | tuple):
        for value in node:
            remember_tree(value, secret)
    elif isinstance(node, str):
        if secret:
            remember(node)
        remember(url_secret(node))


def _split_sweep(value: str) -> list[str]:
    """`a,b` -> [a, b] outside quotes (a sweep's values), plus the whole value itself."""
    parts, current, quote = [], "", ""
    for c in value:
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == ",":
            parts.append(current)
            current = ""
            continue
        current += c
    return [value, *parts, current] if parts else [value]


def _mask_remembered(value: str) -> str:
    with _remembered_lock:
        known = sorted(_remembered, key=len, reverse=True)
    for secret in known:
        if secret in value:
            value = value.replace(secret, MASK)
    return value


def _mask_url(m: re.Match[str]) -> str:
    rest = m.group("rest")
    info, at, host = rest.rpartition("@")
    if not at:
        return m.group(0)
    user, colon, password = info.partition(":")
    keep_user = colon and user and password and not re.search(r"[/?#]", user)
    shown = f"{user}:{MASK}" if keep_user else MASK  # a bare token (`https://TOKEN@host`): all
    return f"{m.group('scheme')}{shown}@{host}"


def _mask_assign(m: re.Match[str]) -> str:
    if not is_secret_name(m.group("name")) or m.group("value") in _UNSET:
        return m.group(0)
    return f"{m.group('name')}={MASK}"


def text(value: str) -> str:
    """Any text with remembered secrets, URL credentials and secret `name=value` values
    masked."""
    return _ASSIGN.sub(_mask_assign, _URL.sub(_mask_url, _mask_remembered(value)))


def params(values: dict[str, Any]) -> dict[str, str]:
    """Flat `{dotted key: value}` (MLflow params or tags): secret keys masked, values' URLs too."""
    return {
        k: MASK if is_secret_name(k) and str(v) not in _UNSET else text(str(v))
        for k, v in values.items()
    }


def tree(node: Any, secret: bool = False) -> Any:
    """A nested dict/list (a config as a container) with secrets masked; everything under a
    secret-named key is masked."""
    if isinstance(node, dict):
        return {k: tree(v, secret or is_secret_name(str(k))) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return [tree(v, secret) for v in node]
    if secret and node is not None and str(node) not in _UNSET:
        return MASK
    return text(node) if isinstance(node, str) else node


def override(line: str) -> str:
    """One Hydra override as typed: a secret key's whole value masked, else `text`."""
    name, eq, value = line.partition("=")
    if eq and is_secret_name(name) and value not in _UNSET:
        return f"{name}={MASK}"
    return text(line)


def overrides(lines: list[str]) -> list[str]:
    return [override(line) for line in lines]


def mask_log_records() -> None:
    """Mask every log record this process makes from now on, whoever logs it and wherever it
    goes (Hydra reconfigures the handlers, not the record factory). Idempotent."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "bapo_masked", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging reports it when the record is emitted
            return record
        masked = text(message)
        if masked != message:
            record.msg, record.args = masked, None
        return record

    factory.bapo_masked = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
