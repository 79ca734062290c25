#include "aotgrad.h"
int main(void) { return 0; }
