// Paged KV pool layout (kv_page.h): per layer K rows then V rows, layers in order, inside each page.
#include "core/kv_page.h"

namespace memra {

Result<KvPageLayout> kv_page_layout(const KvPoolSpec &spec) {
    if (spec.layers.empty()) return make_error("KV pool: no layers");
    if (spec.n_pages < 1) return make_error("KV pool: expected at least 1 page, found {}", spec.n_pages);
    KvPageLayout out;
    int64_t at = 0;
    for (size_t l = 0; l < spec.layers.size(); ++l) {
        const KvPoolLayer &layer = spec.layers[l];
        auto k = kv_row_bytes(spec.k_format, layer.n_kv_heads, layer.head_dim);
        if (!k) return wrap_error(fmt::format("KV pool layer {} K", l), k.error());
        auto v = kv_row_bytes(spec.v_format, layer.n_kv_heads, layer.head_dim);
        if (!v) return wrap_error(fmt::format("KV pool layer {} V", l), v.error());
        out.k_offset.push_back(at);
        at += kKvPageRows * *k;
        out.v_offset.push_back(at);
        at += kKvPageRows * *v;
        out.k_row_bytes.push_back(*k);
        out.v_row_bytes.push_back(*v);
        out.row_elems.push_back(int64_t{layer.n_kv_heads} * layer.head_dim);
    }
    out.page_bytes = at;
    if (spec.n_pages > (int64_t{1} << 62) / at) {
        return make_error("KV pool: {} pages of {} bytes exceed 2^62 bytes", spec.n_pages, at);
    }
    return out;
}

int64_t kv_pool_bytes(const KvPoolSpec &spec, const KvPageLayout &layout) { return spec.n_pages * layout.page_bytes; }

}  // namespace memra
