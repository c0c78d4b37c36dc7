/*
 * Callgrind client requests from SQL: mark a measuring window in the
 * backend that calls them (bench/commit_wakeup.py). Outside valgrind the
 * requests are no-ops.
 *
 *   CREATE FUNCTION cg_zero() RETURNS void
 *       AS '<dir>/callgrind_marks.so', 'cg_zero' LANGUAGE C;
 *   CREATE FUNCTION cg_dump(text) RETURNS void
 *       AS '<dir>/callgrind_marks.so', 'cg_dump' LANGUAGE C STRICT;
 *
 * cg_zero() resets this process's counts (CALLGRIND_ZERO_STATS);
 * cg_dump(label) writes them to a dump file of its own, labelled
 * (CALLGRIND_DUMP_STATS_AT), and resets them.
 */
#include "postgres.h"
#include "fmgr.h"
#include "utils/builtins.h"
#include <valgrind/callgrind.h>

PG_MODULE_MAGIC;

PG_FUNCTION_INFO_V1(cg_zero);
PG_FUNCTION_INFO_V1(cg_dump);

Datum
cg_zero(PG_FUNCTION_ARGS)
{
	CALLGRIND_ZERO_STATS;
	PG_RETURN_VOID();
}

Datum
cg_dump(PG_FUNCTION_ARGS)
{
	char	   *label = text_to_cstring(PG_GETARG_TEXT_PP(0));

	CALLGRIND_DUMP_STATS_AT(label);
	PG_RETURN_VOID();
}
