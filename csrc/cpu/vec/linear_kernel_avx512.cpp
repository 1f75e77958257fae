// The small-batch linear kernel's inner loop built for AVX512 (flags in CMakeLists.txt).

#define TORCHMHA_KERNEL_ISA avx512
#include "linear_kernel_impl.h"
