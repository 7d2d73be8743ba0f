"""Oracle for memra's Jinja interpreter and ChatTemplate (src/text/jinja*, chat_template.*): jinja2 3.1.6
configured exactly as transformers renders chat templates must agree with memra_chat_template_tool, byte for
byte, on (a) make-tiny's chat template, (b) every chat template llama.cpp ships in models/templates (read
from the llama-cpp-python sdist scripts/setup.sh keeps), over conversations with system / user / assistant
turns, reasoning, tool calls with dict arguments, tool results, a tools list, and add_generation_prompt on
and off, and (c) a list of language snippets. Where jinja2 fails on an input, memra must fail too.

The reference is jinja2 set up like transformers.utils.chat_template_utils (requirements-dev.txt pins
jinja2, so this suite needs no heavy oracle); when transformers is installed, the reference itself is
checked against transformers' own apply_chat_template path."""
import json
import os
import shutil
import subprocess
import tarfile
from datetime import datetime
from pathlib import Path

import pytest

from oracle_util import build_tool

jinja2 = pytest.importorskip("jinja2")
from jinja2.ext import Extension, loopcontrols  # noqa: E402
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOOL_NAME = "memra_chat_template_tool"

# llama.cpp templates memra does not render like jinja2, each with the reason. Empty: all of them match.
KNOWN_UNSUPPORTED = {}

# ---- the reference: jinja2 as transformers configures it ---------------------------------------------


class GenerationBlock(Extension):
    """{% generation %}...{% endgeneration %} renders its body (transformers' AssistantTracker, untracked)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class TemplateNamespace(jinja2.utils.Namespace):
    """transformers' namespace(): refuses underscore-prefixed attributes."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"underscore-prefixed namespace attribute {name!r}")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def make_environment():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    env.globals["namespace"] = TemplateNamespace
    return env


ENV = make_environment()
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def template_messages(messages):
    """apply_chat_template's preprocessing: null-valued keys dropped, then reasoning aliased."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def reference_apply(source, case):
    """(True, text) or (False, error) as transformers' apply_chat_template(tokenize=False) would give."""
    context = {"messages": template_messages(json.loads(json.dumps(case["messages"]))),
               "tools": case.get("tools"), "documents": None,
               "add_generation_prompt": case["add_generation_prompt"],
               "bos_token": case["bos_token"], "eos_token": case["eos_token"], **case.get("kwargs", {})}
    return reference_render(source, context)


def reference_render(source, context):
    try:
        return True, ENV.from_string(source).render(**context)
    except Exception as e:  # jinja2 and Python errors alike: memra must fail as well
        return False, f"{type(e).__name__}: {e}"


# ---- memra --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool():
    return build_tool(TOOL_NAME)


def memra_run(tool, tmp_path, source, context, apply):
    """(True, text) or (False, error) from memra_chat_template_tool."""
    template, ctx = tmp_path / "template.jinja", tmp_path / "context.json"
    template.write_text(source, encoding="utf-8")
    ctx.write_text(json.dumps(context, ensure_ascii=False), encoding="utf-8")
    args = [tool, "--apply", template, ctx] if apply else [tool, template, ctx]
    r = subprocess.run(args, capture_output=True, timeout=60)
    assert r.returncode in (0, 1), f"{TOOL_NAME} crashed ({r.returncode}): {r.stderr.decode(errors='replace')}"
    return (True, r.stdout.decode()) if r.returncode == 0 else (False, r.stderr.decode().strip())


def memra_apply(tool, tmp_path, source, case):
    request = {"messages": case["messages"], "tools": case.get("tools"), "kwargs": case.get("kwargs", {}),
               "add_generation_prompt": case["add_generation_prompt"], "bos_token": case["bos_token"],
               "eos_token": case["eos_token"]}
    return memra_run(tool, tmp_path, source, request, True)


# ---- conversations ------------------------------------------------------------------------------------

WEATHER_TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "days": {"type": "integer", "description": "Forecast days"},
            "units": {"type": "string", "enum": ["C", "F"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Web search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]


def case(messages, add_generation_prompt, tools=None, **kwargs):
    return {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
            "kwargs": kwargs, "bos_token": "<s>", "eos_token": "</s>"}


CASES = {
    "multi_turn": case([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about ü and 日本語.\nTwo lines."}], True),
    "single_user_no_prompt": case([{"role": "user", "content": "Hi"}], False),
    "finished_turn_no_prompt": case([
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], False),
    "reasoning": case([
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Adding two and two."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Three plus three."}], False,
        enable_thinking=True),
    "reasoning_prompt": case([
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Adding."},
        {"role": "user", "content": "And 3+3?"}], True, enable_thinking=False),
    "tools": case([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris, then search for news?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
            {"id": "call_2", "type": "function",
             "function": {"name": "search", "arguments": {"query": "Paris news \"today\""}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21}"},
        {"role": "tool", "tool_call_id": "call_2", "name": "search", "content": "Nothing new."},
        {"role": "assistant", "content": "It is 21 degrees; no news."},
        {"role": "user", "content": "Thanks"}], True, tools=WEATHER_TOOLS),
    "tools_listed_no_calls": case([{"role": "user", "content": "Hello"}], True, tools=WEATHER_TOOLS),
}


def llama_cpp_templates():
    """{name: source} of llama.cpp's models/templates/*.jinja: from $MEMRA_LLAMA_CPP_SRC, an unpacked
    llama.cpp tree in the oracle cache, this suite's own copy there, or the llama-cpp-python sdist
    scripts/setup.sh downloads (copied out on first use: llamacpp_step35.py deletes the sdist once it
    has unpacked its converter)."""
    cache = Path(os.environ.get("MEMRA_ORACLE_CACHE", Path.home() / ".cache" / "memra-oracle"))
    dirs = []
    if "MEMRA_LLAMA_CPP_SRC" in os.environ:
        dirs.append(Path(os.environ["MEMRA_LLAMA_CPP_SRC"]) / "models" / "templates")
    dirs += sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp/models/templates"))
    dirs += sorted(cache.glob("llama_cpp_templates-*"))
    for d in dirs:
        if d.is_dir() and any(d.glob("*.jinja")):
            return {p.name: p.read_text(encoding="utf-8") for p in sorted(d.glob("*.jinja"))}
    for sdist in sorted((cache / "sdist").glob("llama_cpp_python-*.tar.gz")):
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".jinja") and
                       "/vendor/llama.cpp/models/templates/" in m.name]
            templates = {Path(m.name).name: tar.extractfile(m).read().decode("utf-8") for m in members}
        if templates:
            version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
            tmp = cache / f".templates-{os.getpid()}"
            tmp.mkdir(parents=True, exist_ok=True)
            for name, text in templates.items():
                (tmp / name).write_text(text, encoding="utf-8")
            try:
                tmp.rename(cache / f"llama_cpp_templates-{version}")  # atomic publish
            except OSError:  # another run published it first
                shutil.rmtree(tmp)
            return templates
    pytest.skip(f"llama.cpp's chat templates not found: no llama-cpp-python sdist in {cache / 'sdist'} "
                "(scripts/setup.sh keeps it) and no unpacked copy; or set MEMRA_LLAMA_CPP_SRC")


def tiny_template():
    return json.loads((ROOT / "models" / "default" / "tokenizer_config.json").read_text())["chat_template"]


def compare(tool, tmp_path, name, source, cases):
    """Mismatch descriptions of memra against the reference over `cases`; the number of renderings."""
    mismatches, rendered = [], 0
    for case_name, c in cases.items():
        want, got = reference_apply(source, c), memra_apply(tool, tmp_path, source, c)
        if want[0]:
            rendered += 1
            if got != want:
                mismatches.append(f"{name} / {case_name}: jinja2 rendered {want[1][:2000]!r}\n"
                                  f"  memra {'rendered' if got[0] else 'failed:'} {got[1][:2000]!r}")
        elif got[0]:
            mismatches.append(f"{name} / {case_name}: jinja2 failed ({want[1][:300]}) but memra rendered "
                              f"{got[1][:500]!r}")
    return mismatches, rendered


# ---- the tests ----------------------------------------------------------------------------------------


def test_tiny_template(tool, tmp_path):
    mismatches, rendered = compare(tool, tmp_path, "make-tiny", tiny_template(), CASES)
    assert not mismatches, "\n".join(mismatches)
    assert rendered == len(CASES), "make-tiny's template must render every conversation"


def test_llama_cpp_templates(tool, tmp_path):
    templates = llama_cpp_templates()
    assert len(templates) >= 50, f"only {len(templates)} llama.cpp templates found"
    stale = sorted(set(KNOWN_UNSUPPORTED) - set(templates))
    assert not stale, f"KNOWN_UNSUPPORTED names templates llama.cpp no longer ships: {stale}"
    mismatches, matched, renderings, failures = [], 0, 0, 0
    for name, source in templates.items():
        if name in KNOWN_UNSUPPORTED:
            continue
        found, rendered = compare(tool, tmp_path, name, source, CASES)
        mismatches += found
        matched += not found
        renderings += rendered
        failures += len(CASES) - rendered
    print(f"llama.cpp templates: {matched} of {len(templates) - len(KNOWN_UNSUPPORTED)} match jinja2 exactly "
          f"({renderings} renderings equal, {failures} inputs jinja2 refuses and memra refuses too); "
          f"{len(KNOWN_UNSUPPORTED)} known unsupported")
    assert not mismatches, f"{len(mismatches)} mismatches:\n" + "\n".join(mismatches)


# Language features beyond what the templates above exercise; rendered with this context.
SNIPPET_CONTEXT = {"xs": [3, 1, 2], "d": {"a": 1, "items": 2}, "s": "héllo wörld", "n": None, "t": True,
                   "msgs": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "x": 1}]}
SNIPPETS = [
    "{% set c = 0 %}{% for i in range(3) %}{% set c = c + 1 %}{{ c }}{% endfor %}{{ c }}",
    "{% set x = 1 %}{% macro m() %}{{ x }}{% endmacro %}{% set x = 2 %}{{ m() }}",
    "{% for x in xs if x > 1 %}{{ loop.index }}/{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}{% endfor %}",
    "{% for x in xs %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}",
    "{% for k, v in d.items() %}{{ k }}={{ v }};{% else %}none{% endfor %}{% for x in [] %}{% else %}empty{% endfor %}",
    "{% set ns = namespace(a=1) %}{% for x in xs %}{% set ns.a = ns.a * x %}{% endfor %}{{ ns.a }}",
    "{% set x %}block {{ 1 + 1 }}{% endset %}[{{ x }}]{% set y | upper %}abc{% endset %}{{ y }}",
    "{% macro g(n, greeting='Hello') %}{{ greeting }} {{ n }}{% endmacro %}{{ g('a') }}|{{ g('b', greeting='Hi') }}",
    "{% macro w() %}[{{ caller() }}]{% endmacro %}{% call w() %}in{% endcall %}{% filter upper %}f{% endfilter %}",
    "{{ 2**3**2 }} {{ 7 // -2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 1e-5 }} {{ 1e16 }} {{ 0.1 + 0.2 }} {{ -2 ** 2 }}",
    "{{ ['a', 1, none, true, 1.5, {'k': \"it's\"}] }} {{ (1,) }} {{ ['\\n', 'é', '\\x00'] }}",
    "{{ s[1] }}|{{ s[::-1] }}|{{ s[2:5] }}|{{ xs[-1] }}|{{ xs[5:0:-2] }}|{{ s|length }}|{{ s|upper }}",
    "{{ u }}|{{ u ~ 'a' }}|{{ u|length }}|{{ u is defined }}|{{ u|default('x') }}|{{ d.zz is defined }}",
    "{{ u.x }}", "{{ u + 1 }}", "{{ d.x.y }}", "{{ xs.append(1) }}", "{{ 'a' + 1 }}", "{{ 1 < 'a' }}",
    "{{ xs|select('odd')|list }}{{ msgs|selectattr('role', 'equalto', 'user')|map(attribute='content')|list }}",
    "{% if msgs|selectattr('role', 'equalto', 'nobody') %}a generator is truthy{% endif %}",
    "{{ msgs|selectattr('role', 'equalto', 'user')|length }}", "{{ xs|map('string')|tojson }}",
    "{{ d|tojson }}|{{ d|tojson(indent=2) }}|{{ 'é'|tojson }}|{{ {'a': [1, 2.0, none]}|tojson(sort_keys=true) }}",
    "{{ xs|sort }}{{ xs|sort(reverse=true) }}{{ ['b', 'A']|sort }}{{ xs|max }}{{ xs|sum }}{{ [1, 1, 2]|unique|list }}",
    "{{ d|dictsort }}{{ {'b': 1, 'a': 2}|dictsort(by='value') }}{{ 'a\\nb'|indent(2, true) }}{{ ' x '|trim }}",
    "{{ 'a,b'.split(',') }}{{ ' a b '.split() }}{{ 'xyx'.strip('x') }}{{ 'abc'.startswith('a') }}{{ '-'.join('ab') }}",
    "{{ '{}-{:>4}'.format(1, 'x') }} {{ '%s=%05.1f' % ('v', 2.25) }} {{ '%d'|format(3) }}",
    "{{ ('<'|safe) + '<' }} {{ '<&>'|e }} {{ 1 if false }}. {{ 'a' if t else 'b' }} {{ t and 'y' or 'n' }}",
    "  {% if t %}\n  yes\n  {% endif %}\n  end\n",
    "a {{- ' b ' -}} c {%- if t %} d {% endif -%}\n e {#- c #} f {% raw %}{{ x }}{% endraw %}",
    "{{ raise_exception('boom') }}", "{{ range(3)|list }}{{ dict(a=1) }}{{ namespace(b=2).b }}",
]


def test_language_snippets(tool, tmp_path):
    mismatches = []
    for source in SNIPPETS:
        want = reference_render(source, SNIPPET_CONTEXT)
        got = memra_run(tool, tmp_path, source, SNIPPET_CONTEXT, False)
        if want[0] != got[0] or (want[0] and want != got):
            mismatches.append(f"{source!r}: jinja2 {want}, memra {got}")
    assert not mismatches, "\n".join(mismatches)


def test_reference_is_transformers():
    """The jinja2 reference above renders exactly as transformers' apply_chat_template path."""
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    tokenization = pytest.importorskip("transformers.tokenization_utils_base")
    templates = {"make-tiny": tiny_template(), **llama_cpp_templates()}
    for name, source in templates.items():
        for case_name, c in CASES.items():
            messages = tokenization._normalize_chat_messages(json.loads(json.dumps(c["messages"])))
            try:
                rendered, _ = utils.render_jinja_template(
                    conversations=[messages], tools=c["tools"], chat_template=source,
                    add_generation_prompt=c["add_generation_prompt"], bos_token=c["bos_token"],
                    eos_token=c["eos_token"], **c["kwargs"])
                want = (True, rendered[0])
            except Exception as e:
                want = (False, f"{type(e).__name__}: {e}")
            ours = reference_apply(source, c)
            assert ours[0] == want[0] and (not ours[0] or ours == want), f"{name} / {case_name}: {ours} != {want}"
