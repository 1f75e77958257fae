// The explicit-weights kernel's row step built for AVX2 (flags in CMakeLists.txt).

#define TORCHMHA_KERNEL_ISA avx2
#include "softmax_rows_impl.h"
