"""Text that leaves the agent never carries a credential or forges a line.

Command lines and environments hold secrets: a model given as
``https://user:pass@hub.example/m?token=abc``, ``--hf-token=hf_...``, ``Authorization: Bearer ...``.
Every value that becomes a label, a log line, a ledger row or a report cell passes through
`scrub` (or `scrub_label` / `escape_control` as the output needs), so one function decides what
"looks like a credential" for all of them.

What is removed, and why each:
  - URL userinfo (``scheme://user:pass@host``): the classic leak through a model or repo URL;
    also without a scheme (``user:pass@host:repo``, as git and ssh take it).
  - URL query strings and fragments: signed URLs (S3, GCS, Azure SAS) carry their keys there.
  - ``name=value`` / ``name: value`` / ``--name value`` where the name says token, key, secret,
    password, passphrase, credential or auth (as a segment, or password/secret/token glued on at
    its end: PGPASSWORD, accessToken; pass/pwd glued to db, root, smtp and the like: --dbpass),
    the value maybe quoted: the value goes, the name stays so a
    reader knows why. Also ``config set NAME VALUE`` (aws, npm, yarn) with such a name.
  - ``Bearer``/``Basic`` authorization values, and whatever an ``Authorization:`` (or
    ``Proxy-Authorization:``) header carries, however short, with or without its scheme word.
  - Cookies: a ``Cookie:`` or ``Set-Cookie:`` header's every ``name=value`` pair (a session
    cookie is a login), and curl's ``-b``/``--cookie`` value (a file name there goes too).
  - The short password options of programs known to take one there: ``-pSECRET`` and
    ``-p SECRET`` after mysql, mariadb (and their tools), sshpass, mongo's tools and
    ``docker login`` (podman, nerdctl, buildah, skopeo), ``-a SECRET`` after redis-cli, and
    curl's ``-u``/``--user`` (``user:SECRET``, all of it goes) and ``-b``/``--cookie``. Only after those programs:
    elsewhere ``-p`` is a port (``-p 8000``), a path or a profile, ``-u`` a user. (For mysql,
    ``-p NAME`` prompts and NAME is the database: it goes too.)
  - Strings shaped like well-known token formats (Hugging Face, GitHub, GitLab, OpenAI, Slack
    tokens and webhook paths, AWS access key ids, Google API keys, npm, PyPI, Stripe and
    Databricks tokens, JWTs), wherever they appear: a bare token needs no name
    to be a secret.
A false positive costs a label its detail; a false negative costs a customer a key, so the
patterns lean towards removing.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from functools import lru_cache

REDACTED = "[redacted]"

# Names that mark the value after them as secret, matched as whole segments of a longer name
# (HF_TOKEN, --hf-token, aws_secret_access_key, db-password, x-api-key) so that --tokenizer,
# author= or max_tokens= keep their values.
_SECRET_WORD = (
    r"(?:token|secret|password|passwd|passphrase|pwd|pass|apikey|api[_-]key|access[_-]key|private[_-]key|key"
    r"|credentials?|auth)"
)
# The name's segments: any before the secret word, the word, any after; never inside a word.
_NAME_BODY = rf"(?:[A-Za-z0-9]+[_.-])*{_SECRET_WORD}(?:[_.-][A-Za-z0-9]+)*(?![A-Za-z0-9])"
# A name that ends in a strong secret word glued on, in any case: PGPASSWORD, HFTOKEN,
# accessToken, clientSecret (max_tokens, --tokenizer and author still keep their values).
# "pass" and "pwd" only glued to what they are the password of (--dbpass, ROOTPWD, smtppass):
# bypass, compass, surpass and OLDPWD (the previous directory) keep their values.
# (The lookahead finds a word ending in pass/pwd in one scan before the prefixes are tried at
# every position of it: without it every word of every label paid for the list.)
_GLUED_BODY = (
    r"(?:[A-Za-z0-9]*(?:password|passwd|passphrase|secret|token)"
    r"|(?=[A-Za-z0-9]*(?:pass|pwd)(?![A-Za-z0-9]))"
    r"[A-Za-z0-9]*(?:db|pg|my|mysql|sql|mongo|redis|root|admin|user|ldap|bind|smtp|mail|ftp|ssh|sudo|vnc|proxy"
    r"|api|auth|app|login|client|server|store|key|trust)(?:pass|pwd))"
)
_SECRET_NAME = rf"(?<![A-Za-z0-9])(?:{_NAME_BODY}|{_GLUED_BODY}(?![A-Za-z0-9]))"

# Userinfo runs to the authority's last "@": a password written unencoded may hold "@", "?" or
# "#" (`postgres://app:p@ss@db/x`), and cut at its first one, the rest of it stayed.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s'\"]*@")
# A password written unencoded may hold "/" too (`https://bob:pa/ss@host/x`), which ended the
# authority above. user:pass with a "/" after the colon and an "@" later is taken for one, unless
# the colon starts a port (`https://host:8080/org/m@v2` is a path's "@").
_URL_USERINFO_SLASH = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s'\"@:]*:(?!\d*(?:[/\s'\"]|$))[^\s'\"@]*/[^\s'\"@]*@"
)
# user:password@host with no scheme, as git, ssh, pip's `git+` and connection strings take it
# (`alice:ghp_x@git.example.com:org/repo`). A word of its own with a host after the "@"; an
# image's digest (`nginx:1.25@sha256:...`) and anything with a "/" before the "@" are no such.
_BARE_USERINFO = re.compile(
    r"(?<![^\s'\"=+,(])[A-Za-z0-9._~%-]+:[^\s'\"/]+@(?!sha\d+:)(?=[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*(?![A-Za-z0-9.@-]))"
)
# A query string or fragment belongs to the URL it follows: from "?" or "#" to the next space.
_URL_QUERY = re.compile(r"(?P<url>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s?#]*)[?#]\S*")
# name=value or name: value (the value runs to whitespace, a quote, "&" or ";"), the name and
# the value each maybe quoted (`--password="x"`, JSON's `"api_key": "x"`).
_NAMED_VALUE = re.compile(
    rf"(?P<name>{_SECRET_NAME}['\"]?)(?P<sep>\s*[=:]\s*['\"]?)(?P<value>[^\s&;'\"]+)", re.IGNORECASE
)
# --name value (a command-line flag whose next word is the secret).
_FLAG_VALUE = re.compile(
    rf"(?P<flag>--?(?:{_NAME_BODY}|{_GLUED_BODY}(?![A-Za-z0-9])))(?P<sep>\s+['\"]?)(?P<value>[^\s'\"-][^\s'\"]*)",
    re.IGNORECASE,
)
# `aws configure set aws_secret_access_key VALUE`, `npm config set _authToken VALUE`: a name and
# its value separated only by a space, after a tool's "config set".
_CONFIG_SET_VALUE = re.compile(
    rf"(?P<cmd>\b(?:configure|config)\s+set\s+(?:-\S+(?:\s+[^\s-]\S*)?\s+)*)"  # options, maybe with values
    rf"(?P<name>[^\s=]*?(?:{_NAME_BODY}|{_GLUED_BODY}(?![A-Za-z0-9])))(?P<sep>\s+['\"]?)(?P<value>[^\s'\"]+)",
    re.IGNORECASE,
)
_AUTH_SCHEME = re.compile(
    r"\b(?P<scheme>Bearer|Basic|Token)(?P<sep>\s+)(?P<value>[A-Za-z0-9._~+/=-]{8,})", re.IGNORECASE
)
# Programs whose short option takes a password: `mysql -pSECRET`, `sshpass -p SECRET`,
# `docker login -p SECRET`, `redis-cli -a SECRET`, `curl -u user:SECRET`. A program is a word of
# its own (maybe a path), so `mysql-coder` is none.
_PASSWORD_PROGRAM = re.compile(
    r"(?<![^\s/'\"])(?:"
    r"(?P<p>mysql[a-z]*|mariadb(?:-[a-z]+)?|sshpass|mongo(?:sh|dump|restore|export|import|stat|top|files)?"
    r"|(?:docker|podman|nerdctl|buildah|skopeo)\s+login)"
    r"|(?P<a>redis-cli)"
    r"|(?P<u>curl)"
    r")(?![^\s'\"])"
)


def _password_option(option: str, *, glued: bool) -> re.Pattern[str]:
    # Case matters: mysql's -P is its port. A short option's value may be glued to it (the rest
    # of the word), a long one's follows "="; or the value is the next word unless that is
    # another option (`mysql -p -u root` prompts).
    sep = "['\"]?" if glued else "=['\"]?"
    return re.compile(
        rf"(?<=\s)(?P<opt>{option})(?:(?P<sep>{sep})(?P<value>[^\s'\"]+)|(?P<gap>\s+['\"]?)(?P<word>[^\s'\"-][^\s'\"]*))"
    )


# curl's cookies (-b, --cookie): "name=value; name2=value2", quoted, holds spaces. Only -b's
# value may be glued on (`-bsid=x`); `--cookie-jar` is another option.
_QUOTED_OR_WORD = r"(?:\"[^\"]*\"|'[^']*'|[^\s'\"])+"  # a shell word: quoted and bare parts run together
_CURL_COOKIE = re.compile(
    rf"(?<=\s)(?P<opt>-b|--cookie)(?:(?P<sep>=|(?<=-b))(?P<value>{_QUOTED_OR_WORD})"
    rf"|(?P<gap>\s+)(?P<word>(?!-)(?:{_QUOTED_OR_WORD})))"
)
_PASSWORD_OPTIONS = {
    "p": (_password_option("-p", glued=True),),
    "a": (_password_option("-a", glued=True),),
    # curl's user:password, for the server (-u, --user) or the proxy (-U, --proxy-user).
    "u": (_password_option("-[uU]", glued=True), _password_option("--(?:proxy-)?user", glued=False), _CURL_COOKIE),
}
_AUTH_PARAM = r"[A-Za-z0-9_-]+=(?:\"[^\"]*\"|[^\s,'\"]*)"
# An HTTP authorization header as a command line gives it (`-H "Authorization: token abc"`,
# `--header Authorization:abc`): its value is a credential whatever its scheme and length.
_AUTH_HEADER = re.compile(
    r"(?<![A-Za-z0-9])(?P<name>(?:Proxy-)?Authorization)(?P<sep>['\"]?\s*[:=]\s*['\"]?)"
    r"(?P<scheme>(?:Bearer|Basic|Token|Digest|Negotiate|NTLM|ApiKey|AWS4-HMAC-SHA256)\s+)?"
    # Digest and AWS4 carry a list of parameters (`username="bob", response="..."`): all of it.
    rf"(?P<value>{_AUTH_PARAM}(?:\s*,\s*{_AUTH_PARAM})*[^\s'\"]*|[^\s'\"]+)",
    re.IGNORECASE,
)
# A cookie header's value: its name=value pairs, "; "-separated, all of them (`-H "Cookie: a=1; b=2"`).
_COOKIE_HEADER = re.compile(
    r"(?<![A-Za-z0-9-])(?P<name>(?:Set-)?Cookie)(?P<sep>['\"]?\s*:\s*['\"]?)(?P<value>[^\s'\";]+(?:;\s*[^\s'\";]+)*)",
    re.IGNORECASE,
)
_TOKEN_SHAPES = re.compile(
    r"\b(?:"
    r"hf_[A-Za-z0-9]{20,}"  # Hugging Face
    r"|gh[pousr]_[A-Za-z0-9]{20,}"  # GitHub
    r"|github_pat_[A-Za-z0-9_]{20,}"
    r"|sk-[A-Za-z0-9_-]{20,}"  # OpenAI and look-alikes
    r"|xox[abposr]-[A-Za-z0-9-]{10,}"  # Slack
    r"|hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9/_-]+"  # Slack webhook URLs: the path is the key
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}"  # AWS access key ids
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"  # JWT
    r"|gl(?:pat|dt|rt|ptt|cbt|soat)-[A-Za-z0-9_-]{20,}"  # GitLab (personal, deploy, runner, CI job...)
    r"|AIza[0-9A-Za-z_-]{35}"  # Google API keys
    r"|npm_[A-Za-z0-9]{36}"  # npm
    r"|pypi-AgE[A-Za-z0-9_-]{50,}"  # PyPI upload tokens
    r"|[rs]k_live_[A-Za-z0-9]{20,}"  # Stripe
    r"|dapi[0-9a-f]{32}"  # Databricks
    r")"
)
# C0 and C1 control characters and DEL. A newline in a value would start a forged log line;
# an escape sequence would repaint a terminal.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _control_escape(match: re.Match[str]) -> str:
    char = match.group()
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(char, f"\\x{ord(char):02x}")


def escape_control(text: str) -> str:
    """Control characters as visible escapes (``\\n``, ``\\x1b``): one value stays one line."""
    return _CONTROL.sub(_control_escape, text) if _CONTROL.search(text) else text


# The longest text a cache keyed by whole texts (here and in attribution) remembers. Such a
# cache keeps its keys after the process they came from has gone, thousands of them: a node
# running a 10,000-task job array whose tasks each carry a 100 KiB cmdline (a whole config in
# the arguments) would hold gigabytes. Longer texts go to `_LongTexts`, bounded by their size.
CACHED_TEXT_MAX_CHARS = 4096
# What `_LongTexts` holds at most, texts and their scrubbed forms together: room for the long
# cmdlines of a node's running GPU processes, which attribution scrubs again whenever their
# readings change (up to every poll, for each rule that matches on the cmdline).
LONG_TEXTS_MAX_CHARS = 1024 * 1024


class _LongTexts:
    """Scrubbed forms of long texts, the most recently asked for first, dropped oldest first
    once they hold more than `max_chars`: a finished process's cmdline goes as others come."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._kept: OrderedDict[str, str] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # scrub is called from the poll, HTTP and action threads

    def scrub(self, text: str) -> str:
        with self._lock:
            found = self._kept.get(text)
            if found is not None:
                self._kept.move_to_end(text)
                return found
        out = _scrub(text)
        with self._lock:
            if text not in self._kept:
                self._kept[text] = out
                self._chars += len(text) + len(out)
            while self._chars > self.max_chars and self._kept:
                old, old_out = self._kept.popitem(last=False)
                self._chars -= len(old) + len(old_out)
        return out


def scrub(text: str) -> str:
    """`text` with everything that looks like a credential removed (see the module docstring).

    Idempotent, and cached: labels repeat every poll, so each distinct value is scrubbed once.
    """
    return _scrub_cached(text) if len(text) <= CACHED_TEXT_MAX_CHARS else _long_texts.scrub(text)


def _scrub(text: str) -> str:
    # One pass can leave what the next would take: a value redacted after a name that glued onto
    # it (`key://;u:p@h` -> `key:[redacted];u:p@h`) makes `...:[redacted];u:p@` userinfo. Passes
    # repeat until nothing changes; each only removes, so few are ever needed.
    out = text
    for _ in range(_MAX_PASSES):
        again = _scrub_once(out)
        if again == out:
            break
        out = again
    return out


_scrub_cached = lru_cache(maxsize=16384)(_scrub)
_long_texts = _LongTexts(LONG_TEXTS_MAX_CHARS)
_MAX_PASSES = 8


def _scrub_once(text: str) -> str:
    if not text:
        return text
    out = _URL_USERINFO.sub(r"\g<scheme>", text)
    out = _URL_USERINFO_SLASH.sub(r"\g<scheme>", out)
    out = _BARE_USERINFO.sub("", out)
    out = _URL_QUERY.sub(r"\g<url>", out)
    out = _AUTH_SCHEME.sub(rf"\g<scheme>\g<sep>{REDACTED}", out)
    out = _AUTH_HEADER.sub(lambda m: m["name"] + m["sep"] + (m["scheme"] or "") + _keep_redacted(m["value"]), out)
    out = _COOKIE_HEADER.sub(lambda m: m["name"] + m["sep"] + _keep_redacted(m["value"]), out)
    out = _password_options(out)  # before the flags: `-psecret` is no flag named "psecret"
    out = _NAMED_VALUE.sub(lambda m: m["name"] + m["sep"] + _keep_redacted(m["value"]), out)
    out = _CONFIG_SET_VALUE.sub(lambda m: m["cmd"] + m["name"] + m["sep"] + _keep_redacted(m["value"]), out)
    out = _FLAG_VALUE.sub(lambda m: m["flag"] + m["sep"] + _keep_redacted(m["value"]), out)
    return _TOKEN_SHAPES.sub(REDACTED, out)


def _password_options(text: str) -> str:
    """`text` with the short password options of each password program (`_PASSWORD_PROGRAM`)
    redacted, from the program's name up to the next such program."""
    programs = list(_PASSWORD_PROGRAM.finditer(text))
    if not programs:
        return text
    pieces = [text[: programs[0].start()]]
    for this, after in zip(programs, [*programs[1:], None], strict=True):
        rest = text[this.end() : after.start() if after is not None else len(text)]
        for option in _PASSWORD_OPTIONS[this.lastgroup or "p"]:
            rest = option.sub(_redact_option, rest)
        pieces += [this.group(), rest]
    return "".join(pieces)


def _redact_option(match: re.Match[str]) -> str:
    if match["value"] is not None:
        return match["opt"] + match["sep"] + _keep_redacted(match["value"])
    return match["opt"] + match["gap"] + _keep_redacted(match["word"])


_WHOLE_SECRET_NAME = re.compile(rf"{_SECRET_NAME}", re.IGNORECASE)


def scrub_named(name: str, value: str) -> str:
    """`value`, which the variable or option `name` holds, scrubbed: all of it where the name
    marks a secret (HF_TOKEN, PGPASSWORD), since a bare value carries nothing `scrub` could tell
    from a team name; else `scrub(value)`."""
    if value and _WHOLE_SECRET_NAME.fullmatch(name):
        return REDACTED
    return scrub(value)


def _keep_redacted(value: str) -> str:
    # A value already redacted by an earlier pattern stays as it is (idempotence).
    return value if value == REDACTED else REDACTED


def scrub_label(text: str) -> str:
    """A label value, ledger field or table cell: no credential, no control character."""
    return escape_control(scrub(text))


# The longest workload label value that leaves the agent. Every name a trusted source gives fits
# (a Kubernetes pod name is at most 253 characters, a systemd unit name 255, a Slurm job id a few
# digits), but a process's own command line and environment hold up to 128 KiB a value
# (MAX_ARG_STRLEN): a `--model` or SLURM_JOB_ID that long would be copied into every series of its
# workload, and a Prometheus with `label_value_length_limit` set fails the whole node's scrape.
LABEL_MAX_CHARS = 256
# A value cut short keeps a digest of the whole, so that two long values stay two workloads.
_DIGEST_CHARS = 16


def bound_label(text: str) -> str:
    """`scrub_label(text)`, cut to `LABEL_MAX_CHARS`: a longer value keeps its start and ends in
    "..." and a digest of the whole (scrubbed) value, so it stays distinct from other values."""
    clean = scrub_label(text)
    if len(clean) <= LABEL_MAX_CHARS:
        return clean
    digest = hashlib.sha256(clean.encode(errors="surrogatepass")).hexdigest()[:_DIGEST_CHARS]
    return f"{clean[: LABEL_MAX_CHARS - _DIGEST_CHARS - 3]}...{digest}"
