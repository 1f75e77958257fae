// The explicit-weights kernel's row step built for AVX512 (flags in CMakeLists.txt).

#define TORCHMHA_KERNEL_ISA avx512
#include "softmax_rows_impl.h"
