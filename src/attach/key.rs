//! The key expression of an attachment: SQL text over the attached table's columns (`'event_id'`,
//! `'source || '':'' || event_id'`, `'dedup.fingerprint(payload)'`), analysed against a table and compiled once per
//! backend, then evaluated for every inserted row.
//!
//! It is analysed as an index expression is (no subqueries, aggregates, window or set-returning functions, no system
//! columns), must not use generated columns (a BEFORE trigger sees them before they are computed), must be
//! of a string type (text, varchar, char, name: anything else needs an explicit cast, so no key is a surprise
//! rendering of a number or a date) and must not be volatile (a key that changes between two deliveries of the same
//! row would dedup nothing). Columns are found by name in the table it is compiled for, so a partition whose columns
//! are numbered differently from its parent's gets the right ones.

use crate::errors::raise;
use crate::{guc, input, ports, xact};
use pgrx::prelude::*;
use std::ffi::CString;

/// A key expression compiled for one table, with the memory it lives in.
pub struct Key {
    context: pg_sys::MemoryContext,
    state: *mut pg_sys::ExprState,
    econtext: *mut pg_sys::ExprContext,
}

impl Drop for Key {
    fn drop(&mut self) {
        // SAFETY: the context holds the expression state and its expression context, used by no one any more.
        unsafe {
            pg_sys::FreeExprContext(self.econtext, false);
            pg_sys::MemoryContextDelete(self.context);
        }
    }
}

/// Analyses `text` as a key expression over the columns of `rel`: an expression of type text. Raises a `dedup:`
/// error naming the problem, with PostgreSQL's own SQLSTATE where the parser found it.
///
/// # Safety
/// `rel` must be an open relation; the expression is allocated in the current memory context.
unsafe fn analyse(rel: pg_sys::Relation, text: &str, hint: impl Fn() -> String) -> *mut pg_sys::Node {
    let invalid = |code: PgSqlErrorCode, why: &str| -> ! {
        raise(code, format!("key {} is not a valid key expression: {why}", quote(text)), hint())
    };
    let sql = CString::new(format!("SELECT {text}"))
        .unwrap_or_else(|_| invalid(PgSqlErrorCode::ERRCODE_SYNTAX_ERROR, "it contains a NUL byte"));
    // What the parser and analyser raise (a syntax error, an unknown column, a subquery) comes back as ours, with
    // its SQLSTATE.
    let analysed = xact::subtransaction(|| {
        // SAFETY: parses and analyses a NUL-terminated string against the caller's open relation.
        unsafe {
            let statements = ports::raw_parser(sql.as_ptr());
            let raw = single_expression(statements)?;
            let pstate = pg_sys::make_parsestate(std::ptr::null_mut());
            (*pstate).p_sourcetext = sql.as_ptr();
            let nsitem = pg_sys::addRangeTableEntryForRelation(
                pstate,
                rel,
                pg_sys::AccessShareLock as i32,
                std::ptr::null_mut(),
                false,
                false,
            );
            pg_sys::addNSItemToQuery(pstate, nsitem, false, true, true);
            let expr = pg_sys::transformExpr(pstate, raw, pg_sys::ParseExprKind::EXPR_KIND_INDEX_EXPRESSION);
            unusable_column(rel, expr)?;
            let type_oid = pg_sys::exprType(expr);
            let (mut category, mut preferred) = (0 as std::ffi::c_char, false);
            pg_sys::get_type_category_preferred(type_oid, &mut category, &mut preferred);
            if category as u8 != pg_sys::TYPCATEGORY_STRING {
                let name = std::ffi::CStr::from_ptr(pg_sys::format_type_be(type_oid)).to_string_lossy().into_owned();
                return Err(format!("it is of type {name}, not text (cast it, e.g. event_id::text)"));
            }
            let expr = pg_sys::coerce_to_target_type(
                pstate,
                expr,
                type_oid,
                pg_sys::TEXTOID,
                -1,
                pg_sys::CoercionContext::COERCION_ASSIGNMENT,
                pg_sys::CoercionForm::COERCE_IMPLICIT_CAST,
                -1,
            );
            pg_sys::assign_expr_collations(pstate, expr);
            pg_sys::free_parsestate(pstate);
            if pg_sys::contain_volatile_functions(expr) {
                return Err("it calls a volatile function (the same row must always give the same key)".into());
            }
            Ok(expr)
        }
    });
    match analysed {
        Ok(Ok(expr)) => expr,
        Ok(Err(why)) => invalid(PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE, &why),
        Err(error) => {
            let report = xact::report_of(&error);
            invalid(report.sql_error_code(), report.message())
        }
    }
}

/// Refuses a key that uses a column the row does not have yet when the BEFORE INSERT trigger computes it: a system
/// column (in a BEFORE trigger every row's ctid is the same invalid one, and xmin is not set: rows would collide),
/// or a generated column (computed after BEFORE triggers, so it is NULL to ours).
///
/// # Safety
/// `rel` must be an open relation and `expr` an analysed expression over it (range-table index 1).
unsafe fn unusable_column(rel: pg_sys::Relation, expr: *mut pg_sys::Node) -> Result<(), String> {
    // SAFETY: reads the expression's column numbers and the relation's tuple descriptor.
    unsafe {
        let mut columns: *mut pg_sys::Bitmapset = std::ptr::null_mut();
        pg_sys::pull_varattnos(expr, 1, &mut columns);
        let mut member = -1;
        loop {
            member = pg_sys::bms_next_member(columns, member);
            if member < 0 {
                return Ok(());
            }
            let attno = member + pg_sys::FirstLowInvalidHeapAttributeNumber;
            if attno < 0 {
                let column = &*pg_sys::SystemAttributeDefinition(attno as pg_sys::AttrNumber);
                return Err(format!(
                    "it uses the system column {}, which a row does not have yet when it is inserted (an index \
                     expression cannot use one either)",
                    std::ffi::CStr::from_ptr(column.attname.data.as_ptr()).to_string_lossy()
                ));
            }
            let desc = pgrx::PgTupleDesc::from_pg_unchecked((*rel).rd_att);
            let Some(column) = desc.get(attno as usize - 1).filter(|c| c.attgenerated != 0) else { continue };
            return Err(format!(
                "it uses the generated column {}, which PostgreSQL computes after BEFORE triggers have run, so \
                 pg_dedup's trigger would see it NULL; use the expression it is generated from instead{}",
                column.name(),
                generation_expression(rel, attno as pg_sys::AttrNumber).map(|e| format!(": {e}")).unwrap_or_default()
            ));
        }
    }
}

/// The expression generated column `attno` of `rel` is computed from, as PostgreSQL prints it.
///
/// # Safety
/// `rel` must be an open relation.
unsafe fn generation_expression(rel: pg_sys::Relation, attno: pg_sys::AttrNumber) -> Option<String> {
    // SAFETY: the relcache keeps every column's default and generation expression in the tuple descriptor's
    // constraints, as node trees printed to text.
    unsafe {
        let constr = (*(*rel).rd_att).constr;
        if constr.is_null() {
            return None;
        }
        let defaults = std::slice::from_raw_parts((*constr).defval, (*constr).num_defval as usize);
        let default = defaults.iter().find(|d| d.adnum == attno)?;
        let expr = pg_sys::stringToNode(default.adbin) as *mut pg_sys::Node;
        let context = pg_sys::deparse_context_for((*(*rel).rd_rel).relname.data.as_ptr(), (*rel).rd_id);
        let printed = pg_sys::deparse_expression(expr, context, false, false);
        Some(std::ffi::CStr::from_ptr(printed).to_string_lossy().into_owned())
    }
}

/// The one expression of `SELECT <expression>`, or why the text was more than that.
///
/// # Safety
/// `statements` must be what `raw_parser` returned.
unsafe fn single_expression(statements: *mut pg_sys::List) -> Result<*mut pg_sys::Node, String> {
    // SAFETY: walks the raw parse tree the caller vouches for.
    unsafe {
        let [raw] = pointers(statements)[..] else {
            return Err("it is more than one expression".into());
        };
        let select = (*(raw as *mut pg_sys::RawStmt)).stmt as *mut pg_sys::SelectStmt;
        let plain = (*select).type_ == pg_sys::NodeTag::T_SelectStmt
            && (*select).fromClause.is_null()
            && (*select).whereClause.is_null()
            && (*select).groupClause.is_null()
            && (*select).havingClause.is_null()
            && (*select).windowClause.is_null()
            && (*select).distinctClause.is_null()
            && (*select).sortClause.is_null()
            && (*select).limitCount.is_null()
            && (*select).limitOffset.is_null()
            && (*select).lockingClause.is_null()
            && (*select).withClause.is_null()
            && (*select).intoClause.is_null()
            && (*select).valuesLists.is_null()
            && (*select).op == pg_sys::SetOperation::SETOP_NONE;
        match pointers((*select).targetList)[..] {
            [target] if plain => Ok((*(target as *mut pg_sys::ResTarget)).val),
            _ => Err("it is not a single expression".into()),
        }
    }
}

/// The elements of a list of pointers (NIL: none).
///
/// # Safety
/// `list` must be NIL or a valid list of pointers.
unsafe fn pointers(list: *mut pg_sys::List) -> Vec<*mut std::ffi::c_void> {
    if list.is_null() {
        return Vec::new();
    }
    // SAFETY: a list's elements are `length` cells; these hold pointers.
    unsafe {
        std::slice::from_raw_parts((*list).elements, (*list).length as usize).iter().map(|c| c.ptr_value).collect()
    }
}

/// `text` quoted as an SQL literal, for messages.
fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// The search path keys are analysed and compiled under. `attach()` stores a key as PostgreSQL prints it under this
/// path (every name outside pg_catalog qualified, as pg_get_indexdef() prints an index expression), so it means the
/// same in every session, whatever that session's search_path.
const KEY_SEARCH_PATH: &std::ffi::CStr = c"pg_catalog, pg_temp";

/// A key as `attach()` stores it.
pub struct Canonical {
    /// As PostgreSQL prints it under `KEY_SEARCH_PATH`: the text that is stored and compiled.
    pub text: String,
    /// The attachment trigger's WHEN clause: the key over `NEW`, in a condition that is always true
    /// (`(<key> IS NULL) OR true`, which the planner folds to `true`, so it costs nothing per row). It is there for
    /// what PostgreSQL does with a WHEN clause: it records the functions, operators and columns the condition uses
    /// as dependencies of the trigger (the way an index expression's are recorded), so dropping one of them is
    /// refused, or cascades to the trigger (and `watch_drop` then removes the attachment); and pg_dump keeps it.
    pub condition: String,
}

/// Checks that `text` is a valid key expression for table `rel` (at `attach()`, under the caller's search_path) and
/// returns its canonical forms.
///
/// # Safety
/// `rel` must be an open relation.
pub unsafe fn canonical(rel: pg_sys::Relation, text: &str) -> Canonical {
    // SAFETY: the caller vouches for the relation; the analysed tree is left to the caller's memory context.
    unsafe {
        let expr = analyse(rel, text, || {
            "Pass one SQL expression over the table's columns, e.g. 'event_id' or 'source || '':'' || event_id'."
                .to_owned()
        });
        guc::with_setting(c"search_path", KEY_SEARCH_PATH, || {
            let print = |alias: &std::ffi::CStr, prefix: bool| {
                let context = pg_sys::deparse_context_for(alias.as_ptr(), (*rel).rd_id);
                let printed = pg_sys::deparse_expression(expr, context, prefix, false);
                std::ffi::CStr::from_ptr(printed).to_string_lossy().into_owned()
            };
            let relname = std::ffi::CStr::from_ptr((*(*rel).rd_rel).relname.data.as_ptr());
            Canonical { text: print(relname, false), condition: format!("({} IS NULL) OR true", print(c"new", true)) }
        })
    }
}

impl Key {
    /// Compiles `text` (a canonical key, see `canonical`) for table `rel`, in memory of its own under `parent`;
    /// `hint` says what to do if it no longer compiles.
    ///
    /// # Safety
    /// `rel` must be an open relation.
    pub unsafe fn compile(
        rel: pg_sys::Relation,
        text: &str,
        parent: pg_sys::MemoryContext,
        hint: impl Fn() -> String,
    ) -> Key {
        // SAFETY: everything is allocated in the new context, which the Key owns; the caller's context comes back.
        unsafe {
            let context = pg_sys::AllocSetContextCreateExtended(
                parent,
                c"dedup attachment key".as_ptr(),
                pg_sys::ALLOCSET_SMALL_MINSIZE as usize,
                pg_sys::ALLOCSET_SMALL_INITSIZE as usize,
                pg_sys::ALLOCSET_SMALL_MAXSIZE as usize,
            );
            let caller = pg_sys::MemoryContextSwitchTo(context);
            let analysed = guc::with_setting(c"search_path", KEY_SEARCH_PATH, || analyse(rel, text, hint));
            let expr = pg_sys::expression_planner(analysed as *mut pg_sys::Expr);
            let state = pg_sys::ExecInitExpr(expr, std::ptr::null_mut());
            let econtext = pg_sys::CreateStandaloneExprContext();
            pg_sys::MemoryContextSwitchTo(caller);
            Key { context, state, econtext }
        }
    }

    /// The key of the row in `slot`, validated like an id, passed to `f` (it lives until `f` returns).
    ///
    /// # Safety
    /// `slot` must hold a row of the table the key was compiled for.
    pub unsafe fn eval<R>(&self, slot: *mut pg_sys::TupleTableSlot, table: &str, f: impl FnOnce(&str) -> R) -> R {
        // SAFETY: evaluates the compiled expression over the row, in the expression context's per-row memory,
        // which is reset once `f` is done with the value.
        unsafe {
            (*self.econtext).ecxt_scantuple = slot;
            let per_row = (*self.econtext).ecxt_per_tuple_memory;
            let caller = pg_sys::MemoryContextSwitchTo(per_row);
            let mut null = false;
            let evalfunc = (*self.state).evalfunc.expect("a compiled expression has an evaluation function");
            let datum = evalfunc(self.state, self.econtext, &mut null);
            pg_sys::MemoryContextSwitchTo(caller);
            let key = (!null).then(|| {
                let text = pg_sys::pg_detoast_datum_packed(datum.cast_mut_ptr());
                pgrx::varlena::text_to_rust_str_unchecked(text)
            });
            let result = f(input::key_of_row(key, table));
            pg_sys::MemoryContextReset(per_row);
            result
        }
    }
}
