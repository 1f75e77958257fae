// The decode kernel's inner loop built for AVX512 (flags in CMakeLists.txt).

#define TORCHMHA_KERNEL_ISA avx512
#include "decode_kernel_impl.h"
