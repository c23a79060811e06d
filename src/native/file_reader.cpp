// Batched O_DIRECT page reads (io_uring with a thread-pool pread fallback). Filled in by the file tier.
#include "bindings.h"

namespace tiergram {

void register_file_reader(nb::module_ &) {}

}  // namespace tiergram
