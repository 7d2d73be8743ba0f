// The Jinja interpreter against jinja2 3.1.6 in transformers' environment (sandboxed, trim_blocks,
// lstrip_blocks, loopcontrols, json.dumps tojson): every expected rendering and every "jinja2:"
// error below was produced by jinja2 itself (transformers.utils.chat_template_utils.
// _compile_jinja_template(source).render(**kContext)) and pasted here; where jinja2 fails, memra
// must fail too, and the test pins memra's message. Then syntax errors with their positions, the
// limits of RenderOptions, strftime_now, and concurrent rendering.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/jinja.h"

namespace memra::text::jinja {
namespace {

using Json = nlohmann::ordered_json;

// The variables every rendering below sees (the same object rendered the jinja2 expectations).
const Json &context() {
    static const Json ctx = Json::parse(R"({
        "s": "héllo wörld", "n": null, "t": true, "f": 1.5, "i": 7, "e": "", "empty": [],
        "xs": [3, 1, 2], "d": {"a": 1, "items": 2},
        "msgs": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "x": 1},
                 {"role": "user", "content": "bye"}]})");
    return ctx;
}

std::string render(std::string_view source, const RenderOptions &options = {}) {
    auto tmpl = Template::parse(source);
    if (!tmpl) return "PARSE ERROR: " + tmpl.error().message;
    auto out = tmpl->render(context(), options);
    return out ? *out : "RENDER ERROR: " + out.error().message;
}

// The error of parsing or rendering `source` ("" if it renders).
std::string render_error(std::string_view source, const RenderOptions &options = {}) {
    auto tmpl = Template::parse(source);
    if (!tmpl) return tmpl.error().message;
    auto out = tmpl->render(context(), options);
    return out ? std::string() : out.error().message;
}

// ---------------------------------------------------------------------------------------------
// Renderings and errors checked against jinja2
// ---------------------------------------------------------------------------------------------

TEST(Jinja, PrintsValuesAsPythonStr) {
    EXPECT_EQ(render(R"j({{ 1.0 }} {{ 0.1 }} {{ 1e-5 }} {{ 1e16 }} {{ 1e15 }} {{ 123456789012345678.0 }} {{ 0.1 + 0.2 }} {{ -0.0 }} {{ 1/3 }})j"),
              "1.0 0.1 1e-05 1e+16 1000000000000000.0 1.2345678901234568e+17 0.30000000000000004 -0.0 0.3333333333333333");
    EXPECT_EQ(render(R"j({{ none }} {{ true }} {{ false }} {{ n }} {{ t }} {{ 42 }} {{ -7 }})j"),
              "None True False None True 42 -7");
    EXPECT_EQ(render(R"j({{ ['a', 1, none, true, 1.5, {'k': "it's"}] }} {{ (1,) }} {{ () }} {{ (1, 'a') }} {{ {'t': (1, 2)} }})j"),
              "['a', 1, None, True, 1.5, {'k': \"it's\"}] (1,) () (1, 'a') {'t': (1, 2)}");
    EXPECT_EQ(render(R"j({{ ['a\nb', 'é', '\x00', '\u2028', "x'y", 'q"', 'b\\', "a'b\"c", '\t\x7f'] }})j"),
              "['a\\nb', 'é', '\\x00', '\\u2028', \"x'y\", 'q\"', 'b\\\\', 'a\\'b\"c', '\\t\\x7f']");
    EXPECT_EQ(render(R"j({{ msgs[0] }} {{ d }} {{ [1.0, 2.5e-7, 1e22, 100.0] }})j"),
              "{'role': 'user', 'content': 'hi'} {'a': 1, 'items': 2} [1.0, 2.5e-07, 1e+22, 100.0]");
    EXPECT_EQ(render(R"j({{ namespace(a=1, b='x') }})j"),
              "<Namespace {'a': 1, 'b': 'x'}>");
    EXPECT_EQ(render(R"j({{ 'a' ~ 1 ~ none ~ true ~ 1.5 ~ [1] }})j"),
              "a1NoneTrue1.5[1]");
}

TEST(Jinja, Whitespace) {
    EXPECT_EQ(render(R"j(  {% if t %}
  yes
  {% endif %}
  end)j"),
              "  yes\n  end");
    EXPECT_EQ(render(R"j(a
  {%- if true %}
    b
  {% endif -%}
  c)j"),
              "a    b\nc");
    EXPECT_EQ(render(R"j(line1
    {% if true %}
    in
    {% endif %}
after   {% if true %}x{% endif %}   tail)j"),
              "line1\n    in\nafter   x   tail");
    EXPECT_EQ(render(R"j({% if true %}   {% endif %}
text {%+ if true %}plus{% endif %})j"),
              "   text plus");
    EXPECT_EQ(render(R"j(  {{ 'var' }}
  {# c #}
  {% set x = 1 %}
y)j"),
              "  var\ny");
    EXPECT_EQ(render(R"j(a {{- 'b' -}}
  c {{+ 'd' }})j"),
              "abc d");
    EXPECT_EQ(render(R"j({%- if t -%}   a   {%- endif -%}   b {{- ' c ' -}} d {#- comment -#} e)j"),
              "ab c de");
    EXPECT_EQ(render(R"j({% for x in xs %}
  {{ x }}
{% endfor %})j"),
              "  3\n  1\n  2\n");
    EXPECT_EQ(render(R"j({% raw -%}   {{ not rendered }}  {%- endraw %}|{%- raw %} {% if %} {% endraw -%}   |)j"),
              "{{ not rendered }}| {% if %} |");
    EXPECT_EQ(render(R"j({# comment #}x{#- c -#}   y {#+ c +#} z)j"),
              "xy  z");
    EXPECT_EQ(render(R"j(a
)j"),
              "a");
    EXPECT_EQ(render(R"j(a
b)j"),
              "a\nb");
    EXPECT_EQ(render(R"j({{ 'crlf' }}
x)j"),
              "crlf\nx");
}

TEST(Jinja, ControlFlow) {
    EXPECT_EQ(render(R"j({% if false %}a{% elif n %}b{% elif i > 5 %}c{% else %}d{% endif %})j"),
              "c");
    EXPECT_EQ(render(R"j({% for k, v in d.items() %}{{ loop.index }}{{ k }}={{ v }};{% endfor %})j"),
              "1a=1;2items=2;");
    EXPECT_EQ(render(R"j({% for x in xs if x > 1 %}{{ loop.index }}/{{ loop.length }}:{{ x }} first={{ loop.first }} last={{ loop.last }} prev={{ loop.previtem }} next={{ loop.nextitem }} rev={{ loop.revindex }},{{ loop.revindex0 }} {% else %}none{% endfor %})j"),
              "1/2:3 first=True last=False prev= next=2 rev=2,1 2/2:2 first=False last=True prev=3 next= rev=1,0 ");
    EXPECT_EQ(render(R"j({% for x in empty %}a{% else %}empty{% endfor %}{% for x in xs if x > 5 %}a{% else %}filtered away{% endfor %})j"),
              "emptyfiltered away");
    EXPECT_EQ(render(R"j({% for x in xs %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %})j"),
              "3");
    EXPECT_EQ(render(R"j({% for a, b in [(1, 2), (3, 4)] %}{{ a + b }}{% endfor %}{% for c in 'hé' %}[{{ c }}]{% endfor %}{% for k in {'a': 1, 'b': 2} %}{{ k }}{% endfor %})j"),
              "37[h][é]ab");
    EXPECT_EQ(render(R"j({% for x in [1] %}{% for y in [2, 3] %}{{ loop.index }}{% endfor %}{{ loop.index }}{% endfor %})j"),
              "121");
    EXPECT_EQ(render(R"j({% for x in xs %}{{ loop.cycle('a', 'b') }}{% if loop.changed(x > 1) %}!{% endif %}{% endfor %})j"),
              "a!b!a!");
    EXPECT_EQ(render(R"j({% with a = 1, b = 2 %}{{ a + b }}{% endwith %}[{{ a }}])j"),
              "3[]");
    EXPECT_EQ(render(R"j({% generation %}gen {{ 1 }}{% endgeneration %})j"),
              "gen 1");
    EXPECT_EQ(render(R"j({% filter upper %}hello {{ s }}{% endfilter %})j"),
              "HELLO HÉLLO WÖRLD");
}

TEST(Jinja, Scoping) {
    EXPECT_EQ(render(R"j({% set count = 0 %}{% for i in range(3) %}{% set count = count + 1 %}{{ count }}{% endfor %}{{ count }})j"),
              "1110");
    EXPECT_EQ(render(R"j({% for i in range(2) %}{% set y = i %}{% endfor %}[{{ y }}])j"),
              "[]");
    EXPECT_EQ(render(R"j({% for i in range(3) %}{% if i == 0 %}{% set z = 5 %}{% endif %}{{ z }},{% endfor %})j"),
              "5,,,");
    EXPECT_EQ(render(R"j({% set ns = namespace(a=1, b=[]) %}{% for x in xs %}{% set ns.a = ns.a + x %}{% endfor %}{{ ns.a }})j"),
              "7");
    EXPECT_EQ(render(R"j({% set ns = namespace(items=[]) %}{% set ns.items = ns.items + [1] %}{{ ns.items }})j"),
              "[1]");
    EXPECT_EQ(render(R"j({% set a, b = 1, 2 %}{{ a }}{{ b }}{% set c, d = [3, 4] %}{{ c }}{{ d }})j"),
              "1234");
    EXPECT_EQ(render(R"j({% set x %}block {{ 1 + 1 }}{% endset %}[{{ x }}]{% set y | upper %}abc{% endset %}{{ y }})j"),
              "[block 2]ABC");
    EXPECT_EQ(render(R"j({% set x = 1 %}{% macro m() %}{{ x }}{% endmacro %}{% set x = 2 %}{{ m() }})j"),
              "2");
    EXPECT_EQ(render(R"j({% macro m() %}[{{ i }}]{% endmacro %}{% for i in range(2) %}{{ m() }}{% endfor %})j"),
              "[7][7]");
    EXPECT_EQ(render(R"j({% set s = 'shadowed' %}{{ s }})j"),
              "shadowed");
}

TEST(Jinja, Macros) {
    EXPECT_EQ(render(R"j({% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ greet('Bob') }} {{ greet('Al', greeting='Hi') }} {{ greet('X', 'Yo') }})j"),
              "Hello, Bob! Hi, Al! Yo, X!");
    EXPECT_EQ(render(R"j({% macro m(a, b=a+1) %}{{ a }}{{ b }}{% endmacro %}{{ m(1) }}{{ m(1, 5) }}{{ m(b=3, a=2) }})j"),
              "121523");
    EXPECT_EQ(render(R"j({% macro m(a) %}[{{ a }}]{% endmacro %}{{ m() }})j"),
              "[]");
    // jinja2: UndefinedError: parameter 'a' was not provided
    EXPECT_EQ(render_error(R"j({% macro m(a, b=a+1) %}{{ b }}{% endmacro %}{{ m() }})j"),
              "line 1: parameter 'a' was not provided");
    EXPECT_EQ(render(R"j({% macro r(n) %}{% if n > 0 %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(5) }})j"),
              "54321");
    EXPECT_EQ(render(R"j({% macro wrap() %}[{{ caller() }}]{% endmacro %}{% call wrap() %}inside{% endcall %})j"),
              "[inside]");
    EXPECT_EQ(render(R"j({% macro li(items) %}{% for i in items %}<{{ caller(i) }}>{% endfor %}{% endmacro %}{% call(x) li([1,2]) %}v{{ x }}{% endcall %})j"),
              "<v1><v2>");
    // jinja2: TypeError: macro 'm' takes not more than 1 argument(s)
    EXPECT_EQ(render_error(R"j({% macro m(a) %}{{ a }}{% endmacro %}{{ m(1, 2) }})j"),
              "line 1: macro 'm' takes not more than 1 argument(s)");
    // jinja2: TypeError: macro 'm' takes no keyword argument 'z'
    EXPECT_EQ(render_error(R"j({% macro m(a) %}{{ a }}{% endmacro %}{{ m(z=1) }})j"),
              "line 1: macro 'm' takes no keyword argument 'z'");
}

TEST(Jinja, Expressions) {
    EXPECT_EQ(render(R"j({{ 2**3**2 }} {{ 7 // -2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 4 / 2 }} {{ 2**-1 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 3 // 2 }} {{ -3 // 2 }} {{ 2 ** 0.5 }} {{ 2 ** 62 }})j"),
              "64 -4 2 3.5 2.0 0.5 3.0 0.5 1 -2 1.4142135623730951 4611686018427387904");
    EXPECT_EQ(render(R"j({{ -1|abs }} {{ - 2 ** 2 }} {{ not 1 == 2 }} {{ 1 + 2 * 3 - 4 / 2 }} {{ 10 % 3 }} {{ true + 1 }} {{ 1_000 + 0x10 + 0o7 + 0b11 }} {{ 1.5e3 }} {{ 2E-2 }})j"),
              "1 4 True 5.0 1 2 1026 1500.0 0.02");
    EXPECT_EQ(render(R"j({{ [1] + [2] }}{{ 'ab' * 3 }}{{ [0] * 2 }}{{ 2 * 'x' }}{{ (1, 2) + (3,) }}{{ 'x' * -1 }})j"),
              "[1, 2]ababab[0, 0]xx(1, 2, 3)");
    EXPECT_EQ(render(R"j({{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 1 == 1.0 }} {{ 1 != 2 }} {{ 'a' in ['a'] }} {{ 'b' not in 'abc' }} {{ 'k' in {'k': 1} }} {{ true == 1 }} {{ 2 >= 2.0 }} {{ 'b' <= 'a' }})j"),
              "True False True True True True True False True True True False");
    EXPECT_EQ(render(R"j({{ [1, 2] == [1, 2] }} {{ {'a': 1} == {'a': 1} }} {{ (1,) == [1] }} {{ none == none }} {{ 'a' == u }} {{ u == u }})j"),
              "True True False True False True");
    EXPECT_EQ(render(R"j({{ not u }} {{ u and 1 }} {{ 0 or 'x' }} {{ [] or u }}.{{ 1 and 2 }} {{ none or false }} {{ '' or 0 }})j"),
              "True  x .2 False 0");
    EXPECT_EQ(render(R"j({{ 'yes' if t else 'no' }} {{ 'yes' if n else 'no' }} [{{ 'x' if n }}] {{ 1 if false else 2 if false else 3 }})j"),
              "yes no [] 3");
    EXPECT_EQ(render(R"j({{ d['items'] }}|{{ d.a }}|{{ xs.0 }}|{{ xs[-1] }}|{{ s[1] }}|{{ s[-1] }}|{{ s[::-1] }}|{{ s[2:5] }}|{{ xs[::2] }}|{{ xs[5:1:-1] }}|{{ xs[:-1] }}|{{ 'abc'[0:100] }})j"),
              "2|1|3|2|é|d|dlröw olléh|llo|[3, 2]|[2]|[3, 1]|abc");
    EXPECT_EQ(render(R"j({{ {'a': 1, 'b': 2}['b'] }} {{ {1: 'one'}[1] }} {{ {'a': {'b': 'c'}}.a.b }} {{ [[1,2],[3]][0][1] }} {{ msgs[-1]['content'] }} {{ msgs[0].role }})j"),
              "2 one c 2 bye user");
    EXPECT_EQ(render(R"j({{ "a\tb" }}{{ 'single \' quote' }}{{ "\x41\u00e9\U0001F600\101" }}{{ '\d' }}{{ 'a' 'b' "c" }})j"),
              "a\tbsingle ' quoteAé😀A\\dabc");
    EXPECT_EQ(render(R"j({{ "%s-%d"|format("a", 3) }} {{ "%05.2f" % 3.14159 }} {{ "%x|%5s|%-5s|%r" % (255, 'ab', 'cd', 'e') }} {{ '%s' % none }} {{ '%d%%' % 50 }} {{ '%(a)s' % {'a': 1} }})j"),
              "a-3 03.14 ff|   ab|cd   |'e' None 50% 1");
    EXPECT_EQ(render(R"j({{ "{} and {}".format(1, 'b') }} {{ "{0}{1}{0}".format('x', 'y') }} {{ "{a}-{b}".format(a=1, b=2) }} {{ "{:>5}|{:<4}|{:^5}|{:.2f}|{:05d}|{:x}".format('ab', 'c', 'd', 3.14159, 42, 255) }})j"),
              "1 and b xyx 1-2    ab|c   |  d  |3.14|00042|ff");
    EXPECT_EQ(render(R"j({{ range(3)|list }} {{ range(1, 10, 3)|list }} {{ range(5, 0, -2)|list }} {{ dict(a=1, b=2) }} {{ dict([('x', 1)]) }} {{ namespace(a=1).a }})j"),
              "[0, 1, 2] [1, 4, 7] [5, 3, 1] {'a': 1, 'b': 2} {'x': 1} 1");
    // jinja2: TypeError: can only concatenate str (not "int") to str
    EXPECT_EQ(render_error(R"j({{ 'a' + 1 }})j"),
              "line 1: can only concatenate str (not \"int\") to str");
    // jinja2: TypeError: unsupported operand type(s) for +: 'int' and 'str'
    EXPECT_EQ(render_error(R"j({{ 1 + 'a' }})j"),
              "line 1: unsupported operand type(s) for +: 'int' and 'str'");
    // jinja2: TypeError: '<' not supported between instances of 'int' and 'str'
    EXPECT_EQ(render_error(R"j({{ 1 < 'a' }})j"),
              "line 1: '<' not supported between instances of 'int' and 'str'");
    // jinja2: ZeroDivisionError: division by zero
    EXPECT_EQ(render_error(R"j({{ 1 / 0 }})j"),
              "line 1: division by zero");
    // jinja2: TypeError: argument of type 'int' is not iterable
    EXPECT_EQ(render_error(R"j({{ 'a' in 1 }})j"),
              "line 1: argument of type 'int' is not iterable");
    // jinja2: TypeError: 'in <string>' requires string as left operand, not int
    EXPECT_EQ(render_error(R"j({{ 5 in 'abc' }})j"),
              "line 1: 'in <string>' requires string as left operand, not int");
    // jinja2: ValueError: slice step cannot be zero
    EXPECT_EQ(render_error(R"j({{ xs[1:2:0] }})j"),
              "line 1: slice step cannot be zero");
}

TEST(Jinja, Undefined) {
    EXPECT_EQ(render(R"j({{ u }}|{{ u ~ 'a' }}|{{ 1 in u }}|{{ u|length }}|{{ u|first }}|{{ u|list }}|{{ u|default('x') }}|{{ u|string }}|{{ u|trim }}|{% for x in u %}never{% endfor %})j"),
              "|a|False|0||[]|x|||");
    EXPECT_EQ(render(R"j({{ u is defined }} {{ u is undefined }} {{ msgs[0].nope is defined }} {{ msgs[0].content is defined }} {{ d.zz is defined }} {{ xs[9] is defined }} {{ 'abc'.zz is defined }} {{ xs.pop is defined }})j"),
              "False True False True False False False False");
    // jinja2: UndefinedError: 'u' is undefined
    EXPECT_EQ(render_error(R"j({{ u.x }})j"),
              "line 1: 'u' is undefined");
    // jinja2: UndefinedError: 'u' is undefined
    EXPECT_EQ(render_error(R"j({{ u + 1 }})j"),
              "line 1: 'u' is undefined");
    // jinja2: UndefinedError: 'u' is undefined
    EXPECT_EQ(render_error(R"j({{ u < 1 }})j"),
              "line 1: 'u' is undefined");
    // jinja2: UndefinedError: 'u' is undefined
    EXPECT_EQ(render_error(R"j({{ u[0] }})j"),
              "line 1: 'u' is undefined");
    // jinja2: UndefinedError: 'u' is undefined
    EXPECT_EQ(render_error(R"j({{ u() }})j"),
              "line 1: 'u' is undefined");
    // jinja2: UndefinedError: 'dict object' has no attribute 'x'
    EXPECT_EQ(render_error(R"j({{ d.x.y }})j"),
              "line 1: 'dict object' has no attribute 'x'");
    // jinja2: UndefinedError: list object has no element 10
    EXPECT_EQ(render_error(R"j({{ xs[10].a }})j"),
              "line 1: list object has no element 10");
    EXPECT_EQ(render(R"j({{ n.x }})j"),
              "");
    // jinja2: TypeError: Object of type Undefined is not JSON serializable
    EXPECT_EQ(render_error(R"j({{ u|tojson }})j"),
              "line 1: Object of type Undefined is not JSON serializable");
}

TEST(Jinja, Tests) {
    EXPECT_EQ(render(R"j({{ x is number }} {{ true is number }} {{ true is integer }} {{ 1.0 is float }} {{ 1 is integer }} {{ t is boolean }} {{ t is true }} {{ t is false }} {{ none is none }} {{ n is not none }})j"),
              "False True False True True True True False True False");
    EXPECT_EQ(render(R"j({{ u is iterable }} {{ d is sequence }} {{ 'a' is sequence }} {{ d is mapping }} {{ xs is iterable }} {{ xs is mapping }} {{ 'a' is string }} {{ 1 is string }} {{ 1 is iterable }})j"),
              "True True True True True False True False False");
    EXPECT_EQ(render(R"j({{ i is odd }} {{ i is even }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(4) }} {{ 'a' is lower }} {{ 'A' is upper }} {{ 'a' is in 'abc' }} {{ 2 is in xs }} {{ 1 is eq 1 }} {{ 1 is equalto 2 }} {{ 2 is gt 1 }} {{ 1 is ne 1 }})j"),
              "True False True False True True True True True False True False");
    // jinja2: TemplateAssertionError: No test named 'frobnicated'.
    EXPECT_EQ(render_error(R"j({{ x is frobnicated }})j"),
              "line 1:9: No test named 'frobnicated'.");
}

TEST(Jinja, Filters) {
    EXPECT_EQ(render(R"j({{ '  hi  '|trim }}|{{ 'xxhixx'|trim('x') }}|{{ [1,2,3]|join(', ') }}|{{ [1, 2] | join }}|{{ ['a', none, 1] | join('|') }}|{{ msgs|join(',', attribute='role') }})j"),
              "hi|hi|1, 2, 3|12|a|None|1|user,assistant,user");
    EXPECT_EQ(render(R"j({{ 'abc'|upper }}|{{ 'ABC'|lower }}|{{ 'aBC dEF'|capitalize }}|{{ 'a b'|title }}|{{ 'hello-world foo(bar'|title }}|{{ "they're"|title }})j"),
              "ABC|abc|Abc def|A B|Hello-World Foo(Bar|They're");
    EXPECT_EQ(render(R"j({{ 'Hello World'|replace('o', '0') }}|{{ 'aaa'|replace('a', 'b', 2) }}|{{ 'ab'|replace('', '-') }})j"),
              "Hell0 W0rld|bba|-a-b-");
    EXPECT_EQ(render(R"j({{ xs|first }}|{{ xs|last }}|{{ 'abc'|first }}|{{ 'abc'|last }}|{{ {'a': 1, 'b': 2}|first }}|{{ []|first }}.)j"),
              "3|2|a|c|a|.");
    EXPECT_EQ(render(R"j({{ xs|sort }}|{{ xs|sort(reverse=true) }}|{{ ['b', 'A', 'c']|sort }}|{{ ['b', 'A', 'c']|sort(case_sensitive=true) }}|{{ [{'n': 2}, {'n': 1}]|sort(attribute='n') }}|{{ [{'n': 2, 'm': 1}, {'n': 1, 'm': 2}]|sort(attribute='m,n') }})j"),
              "[1, 2, 3]|[3, 2, 1]|['A', 'b', 'c']|['A', 'b', 'c']|[{'n': 1}, {'n': 2}]|[{'n': 2, 'm': 1}, {'n': 1, 'm': 2}]");
    EXPECT_EQ(render(R"j({{ xs|max }}|{{ xs|min }}|{{ xs|sum }}|{{ [1, 2.5]|sum }}|{{ ['b', 'A', 'c']|max }}|{{ ['b', 'A', 'c']|min(case_sensitive=true) }}|{{ [{'n': 2}, {'n': 1}]|max(attribute='n') }}|{{ []|max }}.)j"),
              "3|1|6|3.5|c|A|{'n': 2}|.");
    EXPECT_EQ(render(R"j({{ xs|list }}|{{ 'ab'|list }}|{{ d|list }}|{{ xs|length }}|{{ xs|count }}|{{ d|length }}|{{ s|length }}|{{ [1,2,1,'a','A']|unique|list }}|{{ [3,1,2]|reverse|list }}|{{ 'abc'|reverse }})j"),
              "[3, 1, 2]|['a', 'b']|['a', 'items']|3|3|2|11|[1, 2, 'a']|[2, 1, 3]|cba");
    EXPECT_EQ(render(R"j({{ d|dictsort }}|{{ {'b': 1, 'A': 2, 'c': 0}|dictsort }}|{{ {'b': 1, 'A': 2, 'c': 0}|dictsort(by='value') }}|{{ {'b': 1, 'A': 2}|dictsort(true) }}|{{ {'b': 1, 'a': 2}|dictsort(reverse=true) }}|{{ d|items|list }})j"),
              "[('a', 1), ('items', 2)]|[('A', 2), ('b', 1), ('c', 0)]|[('c', 0), ('b', 1), ('A', 2)]|[('A', 2), ('b', 1)]|[('b', 1), ('a', 2)]|[('a', 1), ('items', 2)]");
    EXPECT_EQ(render(R"j({{ msgs|selectattr('role', 'equalto', 'user')|list }}|{{ msgs|rejectattr('role', 'eq', 'user')|map(attribute='content')|list }}|{{ msgs|map(attribute='content')|join(',') }})j"),
              "[{'role': 'user', 'content': 'hi'}, {'role': 'user', 'content': 'bye'}]|['yo']|hi,yo,bye");
    EXPECT_EQ(render(R"j({{ xs|select('odd')|list }}|{{ xs|reject('odd')|list }}|{{ ['a','B']|map('upper')|list }}|{{ msgs|selectattr('x')|list|length }}|{{ msgs|selectattr('x', 'defined')|list|length }}|{{ msgs|map(attribute='zz', default='dflt')|list }}|{{ n|map('upper')|list }}|{{ n|selectattr('x')|list }})j"),
              "[3, 1]|[2]|['A', 'B']|1|1|['dflt', 'dflt', 'dflt']|[]|[]");
    EXPECT_EQ(render(R"j({% if msgs|selectattr('role', 'equalto', 'nobody') %}a generator is truthy{% endif %})j"),
              "a generator is truthy");
    // jinja2: TypeError: object of type 'generator' has no len()
    EXPECT_EQ(render_error(R"j({{ msgs|selectattr('role', 'equalto', 'user')|length }})j"),
              "line 1: object of type 'generator' has no len()");
    // jinja2: TypeError: 'generator' object is not reversible
    EXPECT_EQ(render_error(R"j({{ msgs|selectattr('role', 'equalto', 'user')|last }})j"),
              "line 1: 'generator' object is not reversible");
    EXPECT_EQ(render(R"j({{ d|tojson }}|{{ msgs|tojson }}|{{ {'a': 'é', 'b': none, 'c': 1.0, 'd': [true, false]}|tojson }}|{{ "a\"\n\t\u0001<&>"|tojson }}|{{ d|tojson(sort_keys=true) }}|{{ 'é😀'|tojson(true) }})j"),
              "{\"a\": 1, \"items\": 2}|[{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\", \"x\": 1}, {\"role\": \"user\", \"content\": \"bye\"}]|{\"a\": \"é\", \"b\": null, \"c\": 1.0, \"d\": [true, false]}|\"a\\\"\\n\\t\\u0001<&>\"|{\"a\": 1, \"items\": 2}|\"\\u00e9\\ud83d\\ude00\"");
    EXPECT_EQ(render(R"j({{ d|tojson(indent=2) }}|{{ [1,[2,{}],[]]|tojson(indent=1) }}|{{ {'a': 1}|tojson(indent='\t') }}|{{ [1, 2]|tojson(separators=(',', ':')) }}|{{ {'a': [1]}|tojson(indent=0) }})j"),
              "{\n  \"a\": 1,\n  \"items\": 2\n}|[\n 1,\n [\n  2,\n  {}\n ],\n []\n]|{\n\t\"a\": 1\n}|[1,2]|{\n\"a\": [\n1\n]\n}");
    EXPECT_EQ(render(R"j({{ {1: 'a', none: 'b', true: 'c', 2.5: 'd'}|tojson }} {{ (1e300 * 1e300)|tojson }} {{ (1, 2)|tojson }})j"),
              "{\"1\": \"c\", \"null\": \"b\", \"2.5\": \"d\"} Infinity [1, 2]");
    // jinja2: TypeError: Object of type generator is not JSON serializable
    EXPECT_EQ(render_error(R"j({{ xs|map('string')|tojson }})j"),
              "line 1: Object of type generator is not JSON serializable");
    EXPECT_EQ(render(R"j({{ -3|abs }}|{{ 2.5|round }}|{{ 3.14159|round(2) }}|{{ 2.675|round(2) }}|{{ 0.5|round }}|{{ 1.5|round }}|{{ 5|round }}|{{ 2.7|round(0, 'floor') }}|{{ 2.1|round(0, 'ceil') }})j"),
              "3|2.0|3.14|2.67|0.0|2.0|5|2.0|3.0");
    EXPECT_EQ(render(R"j({{ '42'|int + 1 }}|{{ 'x'|int }}|{{ '3.5'|float }}|{{ 3|float }}|{{ 3.9|int }}|{{ '0x1f'|int(base=16) }}|{{ ' 12 '|int }}|{{ '1_000'|int }}|{{ '1e3'|int }}|{{ 'abc'|int(7) }}|{{ none|int }}|{{ 'inf'|float }}|{{ 'x'|float(2.5) }}|{{ 1|string ~ 2 }})j"),
              "43|0|3.5|3.0|3|31|12|1000|1000|7|0|inf|2.5|12");
    EXPECT_EQ(render(R"j({{ 'a\nb\n\nc'|indent(2) }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\n\nb'|indent(2, blank=true) }}|{{ 'a\nb'|indent('> ') }})j"),
              "a\n  b\n\n  c|  a\n  b|a\n  \n  b|a\n> b");
    EXPECT_EQ(render(R"j({{ 'one two  three'|wordcount }}|{{ '<a href="x">'|e }}|{{ '<a>'|safe }}|{{ ('<'|safe) + '<' }}|{{ '<' + ('<'|safe) }}|{{ '<'|e|e }}|{{ ('<'|safe) is escaped }})j"),
              "3|&lt;a href=&#34;x&#34;&gt;|<a>|<&lt;|&lt;<|&lt;|True");
    EXPECT_EQ(render(R"j({{ 'x'|default('y', true) }} {{ ''|default('y', true) }} {{ ''|default('y') }} {{ none|default('y') }} {{ u|d('z') }})j"),
              "x y  None z");
    EXPECT_EQ(render(R"j({{ 'hello world'|truncate(5) }} {{ 'hello world foo bar'|truncate(9, false, '..', 0) }} {{ 'abcdefgh'|truncate(5, true, '.', 0) }} {{ 'Hello'|center(11) }}|)j"),
              "he... hello.. abcd.    Hello   |");
    EXPECT_EQ(render(R"j({{ 'abc' | batch(2) | list }} {{ [1,2,3] | batch(2, 0) | list }} {{ msgs[0]|attr('role') }}.)j"),
              "[['a', 'b'], ['c']] [[1, 2], [3, 0]] .");
    // jinja2: TemplateAssertionError: No filter named 'frobnicate'.
    EXPECT_EQ(render_error(R"j({{ x | frobnicate }})j"),
              "line 1:8: No filter named 'frobnicate'.");
    EXPECT_EQ(render(R"j({% if false %}{{ x | frobnicate }}{% endif %}an unknown filter in an if fails only when it runs)j"),
              "an unknown filter in an if fails only when it runs");
    // jinja2: TemplateRuntimeError: No filter named 'frobnicate' found.
    EXPECT_EQ(render_error(R"j({% if true %}{{ x | frobnicate }}{% endif %})j"),
              "line 1: No filter named 'frobnicate'");
    // jinja2: TypeError: object of type 'int' has no len()
    EXPECT_EQ(render_error(R"j({{ 5|length }})j"),
              "line 1: object of type 'int' has no len()");
    // jinja2: TypeError: '<' not supported between instances of 'str' and 'int'
    EXPECT_EQ(render_error(R"j({{ [3, 'a']|sort }})j"),
              "line 1: '<' not supported between instances of 'str' and 'int'");
}

TEST(Jinja, Methods) {
    EXPECT_EQ(render(R"j({{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a b c'.rsplit(' ', 1) }}|{{ ' a b  c '.split(none, 1) }}|{{ 'a\nb\r\nc'.splitlines() }})j"),
              "['a', 'b', '', 'c']|['a', 'b']|['a', 'b c']|['a b', 'c']|['a', 'b  c ']|['a', 'b', 'c']");
    EXPECT_EQ(render(R"j({{ '  x '.strip() }}|{{ 'xyx'.strip('x') }}|{{ '  a b  '.lstrip() }}|{{ '  a b  '.rstrip() }}|{{ 'abc'.rstrip('c') }})j"),
              "x|y|a b  |  a b|ab");
    EXPECT_EQ(render(R"j({{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}|{{ 'hello'.find('l') }}|{{ 'héllo'.find('l') }}|{{ 'héllo'.rfind('l') }}|{{ 'x'.find('y') }}|{{ 'hello'.count('l') }})j"),
              "True|True|2|2|3|-1|2");
    EXPECT_EQ(render(R"j({{ '-'.join(['a', 'b']) }}|{{ 'Hi'.upper() }}{{ 'Hi'.lower() }}|{{ 'ab'.replace('a', 'x') }}|{{ 'abc'.capitalize() }}|{{ 'hello world'.title() }}|{{ "they're".title() }}|{{ 'ab'.center(7, '*') }}|{{ 'ab'.ljust(4) }}|{{ 'ab'.rjust(4, '0') }}|{{ '-5'.zfill(4) }})j"),
              "a-b|HIhi|xb|Abc|Hello World|They'Re|***ab**|ab  |00ab|-005");
    EXPECT_EQ(render(R"j({{ d.get('a') }}|{{ d.get('zz') }}|{{ d.get('zz', 5) }}|{{ d.keys()|list }}|{{ d.values()|list }}|{{ d.items()|list }}|{{ xs.index(1) }}|{{ xs.count(3) }}|{{ d.items()|length }})j"),
              "1|None|5|['a', 'items']|[1, 2]|[('a', 1), ('items', 2)]|1|1|2");
    // jinja2: SecurityError: access to attribute 'append' of 'list' object is unsafe.
    EXPECT_EQ(render_error(R"j({{ xs.append(4) }})j"),
              "line 1: access to attribute 'append' of 'list' object is unsafe.");
    // jinja2: TypeError: sequence item 0: expected str instance, int found
    EXPECT_EQ(render_error(R"j({{ ''.join(xs) }})j"),
              "line 1: sequence item 0: expected str instance, int found");
    // jinja2: ValueError: substring not found
    EXPECT_EQ(render_error(R"j({{ 'abc'.index('z') }})j"),
              "line 1: substring not found");
    // jinja2: ValueError: empty separator
    EXPECT_EQ(render_error(R"j({{ 'ab'.split('') }})j"),
              "line 1: empty separator");
}

TEST(Jinja, Globals) {
    // jinja2: TemplateError: boom: 7
    EXPECT_EQ(render_error(R"j({{ raise_exception('boom: ' ~ i) }})j"),
              "line 1: boom: 7");
    // jinja2: OverflowError: Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).
    EXPECT_EQ(render_error(R"j({{ range(200000)|length }})j"),
              "line 1: range too big: the sandbox blocks ranges larger than MAX_RANGE (100000)");
    // jinja2: SecurityError: Chat templates cannot store underscore-prefixed attributes on a namespace, but got '_
    EXPECT_EQ(render_error(R"j({% set ns = namespace() %}{% set ns._x = 1 %})j"),
              "line 1: chat templates cannot store underscore-prefixed attributes on a namespace ('_x')");
    // jinja2: TemplateRuntimeError: cannot assign attribute on non-namespace object
    EXPECT_EQ(render_error(R"j({% set nope.x = 1 %})j"),
              "line 1: cannot assign attribute on non-namespace object 'nope'");
    // jinja2: UndefinedError: 'foo' is undefined
    EXPECT_EQ(render_error(R"j({{ foo(1) }})j"),
              "line 1: 'foo' is undefined");
}

TEST(Jinja, Unicode) {
    EXPECT_EQ(render(R"j({{ s|upper }}|{{ 'ÀÉ'|lower }}|{{ 'αβγ'|upper }}|{{ 'ПРИВЕТ'|lower }}|{{ '日本語'[1] }}|{{ '日本語'|length }}|{{ '😀x'[0] }}|{{ '日本語'[::-1] }}|{{ 'é'|center(3) }}|{{ 'naïve café'.split() }})j"),
              "HÉLLO WÖRLD|àé|ΑΒΓ|привет|本|3|😀|語本日| é |['naïve', 'café']");
    EXPECT_EQ(render(R"j({{ ['日本', 'é'] }} {{ {'ключ': 'значение'}|tojson }} {{ '日本'|tojson(ensure_ascii=true) }}
)j"),
              "['日本', 'é'] {\"ключ\": \"значение\"} \"\\u65e5\\u672c\"");
}

// ---------------------------------------------------------------------------------------------
// Syntax and runtime errors: positions and lines
// ---------------------------------------------------------------------------------------------

// Syntax errors give line:column (in characters) of the offending token; jinja2 rejects each of
// these templates too.
TEST(Jinja, SyntaxErrorsNameLineAndColumn) {
    EXPECT_EQ(render_error("{% for %}"), "line 1:8: expected a variable name to assign to, found '%}'");
    EXPECT_EQ(render_error("{% if x %}"), "line 1:11: expected 'elif' or 'else' or 'endif', found end of template");
    EXPECT_EQ(render_error("a\n{{ 'é' }}\n{% foo %}"), "line 3:4: unknown tag 'foo'");
    EXPECT_EQ(render_error("a\n{{ 'é' }}\n{% endfor %}"), "line 3:4: unknown tag 'endfor'");
    EXPECT_EQ(render_error("héllo {{ (1 }}"), "line 1:13: unexpected '}', expected ')'");
    EXPECT_EQ(render_error("{{ 1 }}\n {{ x | }}"), "line 2:9: expected a filter name, found '}}'");
    EXPECT_EQ(render_error("{{ 'unterminated }}"), "line 1:4: unexpected char '''");
    EXPECT_EQ(render_error("x {# never closed"), "line 1:3: missing end of comment tag");
    EXPECT_EQ(render_error("{{ 1 +"), "line 1:1: unexpected end of template, expected '}}'");
    EXPECT_EQ(render_error("{% set 1 = 2 %}"), "line 1:8: expected a variable name to assign to, found '1'");
    EXPECT_EQ(render_error("{% break %}"), "line 1:4: 'break' outside a loop, found 'break'");
    EXPECT_EQ(render_error("{% include 'x' %}"), "line 1:4: 'include' is not supported: a chat template is a single template");
    EXPECT_EQ(render_error("\n  {{ x | frobnicate }}"), "line 2:10: No filter named 'frobnicate'.");
    EXPECT_EQ(render_error("{{ x is frobnicated }}"), "line 1:9: No test named 'frobnicated'.");
    EXPECT_EQ(render_error("{{ '\\N{DASH}' }}"), "line 1:5: named Unicode escapes (\\N{...}) are not supported");
}

TEST(Jinja, RuntimeErrorsNameTheLine) {
    EXPECT_EQ(render_error("{% set a = 1 %}\n{{ a }}\n{{ a + u }}"), "line 3: 'u' is undefined");
    EXPECT_EQ(render_error("{% macro m(x) %}\n\n{{ x.y.z }}{% endmacro %}{{ m({}) }}"),
              "line 3: 'dict object' has no attribute 'y'");
    EXPECT_EQ(render_error("{% if true %}\n{{ raise_exception('Only user and assistant roles are supported!') }}"
                           "{% endif %}"),
              "line 2: Only user and assistant roles are supported!");
}

// Unknown constructs fail with a message, never a crash: a template that jinja2 compiles but memra
// does not support says so.
TEST(Jinja, UnsupportedConstructsAreErrors) {
    EXPECT_EQ(render_error("{% for x in xs recursive %}{% endfor %}"),
              "line 1:16: recursive loops are not supported");
    EXPECT_EQ(render_error("{{ range(*xs) }}"), "line 1:10: *args and **kwargs in calls are not supported, found '*'");
    EXPECT_EQ(render_error("{{ 10 ** 20 }}"), "line 1: integer overflow (Python integers are unbounded, memra's are 64-bit)");
}

// ---------------------------------------------------------------------------------------------
// Limits: every runaway template ends with a clear error
// ---------------------------------------------------------------------------------------------

TEST(Jinja, OutputSizeIsBounded) {
    RenderOptions small;
    small.max_output_bytes = 500;
    EXPECT_EQ(render("{% for i in range(50) %}0123456789{% endfor %}", small).size(), 500u);
    EXPECT_EQ(render_error("{% for i in range(51) %}0123456789{% endfor %}", small), "line 1: output exceeds 500 bytes");
    // Strings built on the way count too, not only what is printed.
    EXPECT_EQ(render_error("{% set x = 'ab' * 300 %}", small), "line 1: output exceeds 500 bytes");
    EXPECT_EQ(render_error("{% set x = ['a'] * 600 %}{% set y = x|join %}", small), "line 1: output exceeds 500 bytes");
    EXPECT_EQ(render_error("{% set x %}{% for i in range(60) %}0123456789{% endfor %}{% endset %}", small),
              "line 1: output exceeds 500 bytes");
    // Printing and formatting stop at the limit too, before building the whole text.
    EXPECT_EQ(render_error("{% set s = 'x' * 400 %}{{ [s, s] }}", small), "line 1: output exceeds 500 bytes");
    EXPECT_EQ(render_error("{% set s = 'x' * 400 %}{{ 'a' ~ [s, s] }}", small), "line 1: output exceeds 500 bytes");
    EXPECT_EQ(render_error("{{ ([[1, 2]] * 10) | tojson(indent=100) }}", small), "line 1: output exceeds 500 bytes");
    EXPECT_EQ(render_error("{{ '{:>100000000000}'.format(1) }}", small), "line 1: output exceeds 500 bytes");
    EXPECT_EQ(render_error("{% set s = 'x' * 400 %}{{ '%s%s' % (s, s) }}", small), "line 1: output exceeds 500 bytes");
    // Doubling a string 64 times would need 2^65 bytes; the default limit (64 MiB) stops it.
    EXPECT_EQ(render_error("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                           "{% endfor %}"),
              "line 1: output exceeds 67108864 bytes");
}

TEST(Jinja, IterationsAreBounded) {
    RenderOptions small;
    small.max_iterations = 10'000;
    EXPECT_EQ(render_error("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}", small),
              "line 1: more than 10000 loop iterations and built elements");
    EXPECT_EQ(render_error("{{ [0] * 100000 }}", small), "line 1: more than 10000 loop iterations and built elements");
    // Work on long strings counts (a unit per 256 bytes walked), so repeating it is bounded as well.
    auto tmpl = Template::parse("{% for i in range(100) %}{% set t = big.upper() %}{% set c = big[5] %}{% endfor %}");
    ASSERT_TRUE(tmpl);
    const Json ctx{{"big", std::string(1 << 20, 'x')}};
    EXPECT_TRUE(tmpl->render(ctx));
    auto out = tmpl->render(ctx, small);
    ASSERT_FALSE(out);
    EXPECT_EQ(out.error().message, "line 1: more than 10000 loop iterations and built elements");
    // jinja2's sandbox refuses ranges beyond MAX_RANGE = 100000 (jinja2: OverflowError: Range too big).
    EXPECT_EQ(render_error("{% for i in range(10**12) %}{% endfor %}"),
              "line 1: range too big: the sandbox blocks ranges larger than MAX_RANGE (100000)");
}

TEST(Jinja, DepthIsBounded) {
    // Unbounded macro recursion (jinja2: RecursionError).
    EXPECT_EQ(render_error("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"),
              "line 1: nesting deeper than 500 levels (macro recursion or nested expressions)");
    RenderOptions shallow;
    shallow.max_depth = 50;
    EXPECT_EQ(render("{% macro r(n) %}{% if n > 0 %}{{ r(n - 1) }}{% endif %}{{ n }}{% endmacro %}{{ r(5) }}", shallow),
              "012345");
    EXPECT_EQ(render_error("{% macro r(n) %}{% if n > 0 %}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(50) }}", shallow),
              "line 1: nesting deeper than 50 levels (macro recursion or nested expressions)");
    // Values nested by a loop, which printing and destruction would walk recursively.
    EXPECT_EQ(render_error("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}{% set ns.x = [ns.x] %}{% endfor %}"),
              "line 1: a value nested deeper than 500 levels");
    // Parser recursion on deeply nested input.
    EXPECT_EQ(render_error("{{ " + std::string(300, '(') + "1" + std::string(300, ')') + " }}"),
              "line 1:104: nesting deeper than 200 levels");
    EXPECT_EQ(render_error("{{ " + std::string(300, '-') + "1 }}"), "line 1:203: nesting deeper than 200 levels");
    std::string chain = "{{ 1";
    for (int k = 0; k < 300; ++k) chain += " + 1";
    EXPECT_EQ(render_error(chain + " }}"), "line 1:802: expression nested deeper than 200 levels");
    std::string ifs;
    for (int k = 0; k < 300; ++k) ifs += "{% if true %}";
    EXPECT_EQ(render_error(ifs), "line 1:2581: nesting deeper than 200 levels");
    // A context nested deeper than max_depth.
    Json deep = Json::array();
    for (int k = 0; k < 600; ++k) deep = Json::array({deep});
    auto tmpl = Template::parse("{{ x|length }}");
    ASSERT_TRUE(tmpl);
    auto out = tmpl->render(Json{{"x", deep}});
    ASSERT_FALSE(out);
    EXPECT_EQ(out.error().message, "the context is nested too deeply");
}

// A namespace cannot hold a namespace, directly or inside a list: that would allow a reference cycle.
TEST(Jinja, NamespacesCannotHoldNamespaces) {
    EXPECT_EQ(render_error("{% set ns = namespace() %}{% set ns.me = ns %}"), "line 1: a namespace cannot hold a namespace");
    EXPECT_EQ(render_error("{% set ns = namespace() %}{% set ns.l = [1, [ns]] %}"),
              "line 1: a namespace cannot hold a namespace");
    EXPECT_EQ(render("{% set ns = namespace(a=1) %}{% set l = [ns, ns] %}{{ l[1].a }}"), "1");
}

// ---------------------------------------------------------------------------------------------
// The API
// ---------------------------------------------------------------------------------------------

TEST(Jinja, StrftimeNowFormatsTheGivenTime) {
    RenderOptions options;
    std::tm now{};
    now.tm_year = 2024 - 1900;
    now.tm_mon = 2;
    now.tm_mday = 5;
    now.tm_hour = 14;
    now.tm_min = 7;
    now.tm_sec = 9;
    now.tm_wday = 2;
    options.now = now;
    EXPECT_EQ(render("{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%Y-%m-%d %H:%M:%S %A') }}|{{ strftime_now('') }}",
                     options),
              "05 Mar 2024|2024-03-05 14:07:09 Tuesday|");
    EXPECT_EQ(render("{{ strftime_now('%Y')|length }}"), "4");  // the current time
}

TEST(Jinja, ContextMustBeAnObject) {
    auto tmpl = Template::parse("x");
    ASSERT_TRUE(tmpl);
    auto out = tmpl->render(Json::array());
    ASSERT_FALSE(out);
    EXPECT_EQ(out.error().message, "render context: expected a JSON object, found array");
    // Context keys shadow the globals.
    EXPECT_EQ(tmpl->render(Json{{"range", 1}}).value_or("?"), "x");
    auto shadow = Template::parse("{{ range }}");
    EXPECT_EQ(shadow->render(Json{{"range", "mine"}}).value_or("?"), "mine");
}

// Invalid UTF-8 never reaches Python; memra counts each invalid byte as one character and passes
// it through.
TEST(Jinja, InvalidUtf8IsCountedByteByByte) {
    auto tmpl = Template::parse("{{ s|length }}|{{ s[1] == '\xfe' }}|{{ s }}\xff");
    ASSERT_TRUE(tmpl);
    EXPECT_EQ(tmpl->render(Json{{"s", "a\xfe\xff"}}).value_or("?"), "3|True|a\xfe\xff\xff");
}

TEST(Jinja, RendersConcurrentlyFromOneParse) {
    auto tmpl = Template::parse(
        "{% set ns = namespace(total=0) %}{% for m in msgs %}{% set ns.total = ns.total + m.n %}"
        "{{ loop.index }}:{{ m.text|upper }};{% endfor %}{{ ns.total }}");
    ASSERT_TRUE(tmpl);
    const Template copy = *tmpl;  // copies share the parsed tree
    std::vector<std::string> results(8);
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t) {
        threads.emplace_back([&, t] {
            Json msgs = Json::array();
            for (int k = 0; k <= t; ++k) msgs.push_back({{"n", k}, {"text", "m" + std::to_string(k)}});
            for (int rep = 0; rep < 50; ++rep) {
                auto out = (t % 2 ? copy : *tmpl).render(Json{{"msgs", msgs}});
                if (rep == 0 || !out || *out != results[static_cast<size_t>(t)]) {
                    results[static_cast<size_t>(t)] = out ? *out : out.error().message;
                }
            }
        });
    }
    for (auto &th : threads) th.join();
    EXPECT_EQ(results[0], "1:M0;0");
    EXPECT_EQ(results[3], "1:M0;2:M1;3:M2;4:M3;6");
    EXPECT_EQ(results[7], "1:M0;2:M1;3:M2;4:M3;5:M4;6:M5;7:M6;8:M7;28");
}

}  // namespace
}  // namespace memra::text::jinja
