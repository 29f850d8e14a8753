/* SPDX-License-Identifier: Apache-2.0 */
/* The layout and part tests of tests/unit/test_layouts.c on the test bed's
 * real rxe devices: MLA, K/V with aux and state groups, chunked and
 * layer-wise sends, every byte verified and the WR counts checked. */
#define LAYOUTS_ON_RXE 1
#include "../unit/test_layouts.c"
