// The small-batch linear kernel's inner loop built for AVX2 (flags in CMakeLists.txt).

#define TORCHMHA_KERNEL_ISA avx2
#include "linear_kernel_impl.h"
