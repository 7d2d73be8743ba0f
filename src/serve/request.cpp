#include "serve/request.h"

namespace memra::serve {

const char *finish_name(Finish finish) {
    switch (finish) {
    case Finish::kNone: return "none";
    case Finish::kStop: return "stop";
    case Finish::kLength: return "length";
    case Finish::kCancelled: return "cancelled";
    case Finish::kTimeout: return "timeout";
    case Finish::kError: return "error";
    }
    return "none";
}

}  // namespace memra::serve
