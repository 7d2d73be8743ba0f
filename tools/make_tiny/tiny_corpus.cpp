// Training text for the tiny tokenizer, written for memra (no third-party text). Its content only
// needs to be varied and repetitive enough for a few hundred merges with count >= 2.
#include "make_tiny/tiny_corpus.h"

namespace memra::tools {

namespace {

constexpr std::string_view kCorpus =
    R"corpus(The lighthouse keeper counted the ships every evening. There were seven on Monday, nine on
Tuesday, and on Wednesday the harbor was so quiet that she counted the gulls instead. The gulls
were louder than the ships, and they never kept to the schedule.

When the fog came in from the sea, the keeper lit the lamp early and wrote in her notebook:
"Wind from the west, waves of two meters, visibility poor. The bread is stale again." She liked
to write the weather first and the small complaints after, because the weather was the reason
she was there and the bread was only the reason she was hungry.

A traveler once asked her whether the work was lonely. She answered that the lamp was good
company: it turned, it shone, it asked for oil, and it did not argue. The traveler laughed,
thanked her for the tea, and walked down the long stairs to the boat that was waiting below.

Reading the notes later, you can see the seasons change. In spring the entries are short and
hopeful; in summer they mention tourists, ice cream and the noise of engines; in autumn the
storms return, and the handwriting grows larger, as if the letters themselves were leaning
against the wind. In winter she writes about the stars, which are clearer when the air is cold.

def count_tokens(text, vocab):
    """Return how many tokens the greedy matcher produces for text."""
    total = 0
    position = 0
    while position < len(text):
        for length in range(min(16, len(text) - position), 0, -1):
            piece = text[position:position + length]
            if piece in vocab:
                total += 1
                position += length
                break
        else:
            total += 1
            position += 1
    return total


for index, value in enumerate([3, 1, 4, 1, 5, 9, 2, 6]):
    print(f"item {index}: {value} -> {value * value}")

#include <cstdio>
#include <vector>

int sum_of_squares(const std::vector<int> &values) {
    int total = 0;
    for (int value : values) {
        total += value * value;
    }
    return total;
}

int main() {
    std::vector<int> values = {1, 2, 3, 4, 5, 6, 7, 8};
    std::printf("sum of squares: %d\n", sum_of_squares(values));
    return 0;
}

struct Point { float x; float y; };
static float dot(const Point &a, const Point &b) { return a.x * b.x + a.y * b.y; }

{"name": "harbor", "ships": [7, 9, 0], "visibility": "poor", "wind_speed_kmh": 38.5, "open": true}
{"name": "bakery", "loaves": 120, "price": 2.75, "open": false, "tags": ["bread", "rolls", "cake"]}

SELECT name, COUNT(*) AS visits FROM harbor_log WHERE year = 2024 GROUP BY name ORDER BY visits DESC;

Numbers and dates: 0, 1, 2, 10, 12, 100, 123, 1000, 2048, 4096, 65536, 1234567, 3.14159, 2.71828,
-42, +17, 0.001, 1e-5, 6.02e23, 2024-03-15, 2025-11-30, 12:45:07, 07:30, 99.9%, $19.99, #42.
Phone 555-0100, room 314, gate B12, flight 2718, invoice 000451, version 1.2.3, port 8080.
The sum of 128 and 256 is 384; 384 times 2 is 768; 768 plus 256 is 1024.

灯塔守望者每天晚上数着来往的船只。星期一有七艘，星期二有九艘。海雾来的时候，她早早点亮了灯，
在笔记本上写下天气和风向。春天的记录很短，夏天的记录很热闹，秋天的风暴又回来了，冬天她写星星。
我们今天学习中文和日文，也学习数字和标点符号。计算机读取文本，然后把文本切成小块。

灯台の番人は毎晩、船の数を数えていました。霧が出ると、早めにランプをつけてノートに天気を書きました。
春の記録は短く、夏はにぎやかで、秋には嵐が戻り、冬には星のことを書きます。カタカナとひらがなも使います。
プログラムはテキストを読み、トークンに分けて、数字に変えます。ありがとうございます。

Emoji notes: 🙂 😀 🚀 🌊 🌟 ❤️ 👍 🎉 🐢 🍞 ☕ 🌧️ ⛵ 🙂🙂 🚀🚀 🌊🌊🌊 👍👍 — and a few symbols: © ® ™ ° ± × ÷ € £ ¥ → ← ↑ ↓ ∑ ∞ ≈ ≠ ≤ ≥.
Accents: café, naïve, façade, über, señor, crème brûlée, smörgåsbord, Ångström, déjà vu, coöperate.

Whitespace runs:
    four spaces before this line
        eight spaces before this line
	one tab before this line
		two tabs before this line
trailing spaces here   
and a blank line follows


two blank lines came before this line.
a  b   c    d     e      f
x = 1;   y = 2;    z = x + y;

Short lines repeat so that common words merge: the ship, the sea, the lamp, the wind, the keeper.
She counted the ships. She counted the gulls. She wrote the weather. She wrote the stars.
In the evening the harbor was quiet. In the morning the harbor was busy. The lamp turned all night.
return total; return values; return 0; for value in values: print(value)
if (value > 0) { total += value; } else { total -= value; }
)corpus";

}  // namespace

std::string_view tiny_training_corpus() {
    return kCorpus;
}

}  // namespace memra::tools
