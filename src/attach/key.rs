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
use crate::{guc, ports, rights, xact};
use pgrx::prelude::*;
use std::ffi::CString;

/// A key expression compiled for one table, with the memory it lives in.
pub struct Key {
    context: pg_sys::MemoryContext,
    state: *mut pg_sys::ExprState,
    econtext: *mut pg_sys::ExprContext,
    /// Set while the key is being computed: an expression state cannot be evaluated again from inside its own
    /// evaluation (a function of the key that inserts into the table), whose intermediate results it holds.
    busy: std::cell::Cell<bool>,
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
unsafe fn analyse(rel: pg_sys::Relation, text: &str, table: &str, hint: impl Fn() -> String) -> *mut pg_sys::Node {
    let invalid = |code: PgSqlErrorCode, why: &str| -> ! {
        raise(code, format!("key {} of {table} is not a valid key expression: {why}", quote(text)), hint())
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
            unusable_column(rel, table, expr)?;
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
/// or a generated column (computed after BEFORE triggers, so it is NULL to ours); and one over the whole row, whose
/// text is a rendering of the table's definition (it changes with the table's name and columns).
///
/// # Safety
/// `rel` must be an open relation and `expr` an analysed expression over it (range-table index 1).
unsafe fn unusable_column(rel: pg_sys::Relation, table: &str, expr: *mut pg_sys::Node) -> Result<(), String> {
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
            if attno == 0 {
                return Err(format!(
                    "it uses the whole row ({table}.*), whose text changes with the table's definition; name the \
                     columns the key is made of"
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
        let [target] = pointers((*select).targetList)[..] else { return Err("it is not a single expression".into()) };
        let expr = (*(target as *mut pg_sys::ResTarget)).val;
        // `*` and `t.*` are a target list's shorthand for every column, not an expression.
        let star = (*expr).type_ == pg_sys::NodeTag::T_ColumnRef
            && pointers((*(expr as *mut pg_sys::ColumnRef)).fields)
                .last()
                .is_some_and(|field| (*(*field as *mut pg_sys::Node)).type_ == pg_sys::NodeTag::T_A_Star);
        if !plain || star {
            return Err("it is not a single expression".into());
        }
        Ok(expr)
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

/// A key as `attach()` stores it: its text as PostgreSQL prints it under `KEY_SEARCH_PATH` (what is stored and
/// compiled), and the expression analysed from it (in the caller's memory context), whose dependencies `attach()`
/// records.
pub struct Canonical {
    pub text: String,
    pub expr: *mut pg_sys::Node,
}

/// Checks that `text` is a valid key expression for table `rel` (at `attach()`, under the caller's search_path) and
/// returns its canonical form. Analysed as the table's owner, in a security-restricted operation, as PostgreSQL
/// analyses and evaluates an index expression: a key is parsed into constants, and a constant of a domain type runs
/// the domain's checks, which must never run with the rights of whoever attaches (a superuser, or the extension's
/// update) what another role wrote.
///
/// # Safety
/// `rel` must be an open relation.
pub unsafe fn canonical(rel: pg_sys::Relation, text: &str, table: &str) -> Canonical {
    // The caller's search path with `$user` resolved for the caller, before the switch of role.
    let path = Spi::get_one::<String>(
        "SELECT pg_catalog.string_agg(pg_catalog.quote_ident(s), ', ') FROM pg_catalog.unnest(pg_catalog.current_schemas(true)) s",
    )
    .ok()
    .flatten()
    .and_then(|path| CString::new(path).ok())
    .unwrap_or_else(|| KEY_SEARCH_PATH.to_owned());
    // SAFETY: the caller vouches for the relation; the analysed tree is left to the caller's memory context.
    unsafe {
        let expr = rights::as_table_owner((*rel).rd_id, || {
            guc::with_setting(c"search_path", &path, || {
                analyse(rel, text, table, || {
                    "Pass one SQL expression over the table's columns, e.g. 'event_id' or 'source || '':'' || event_id'."
                        .to_owned()
                })
            })
        });
        let text = guc::with_setting(c"search_path", KEY_SEARCH_PATH, || {
            let relname = (*(*rel).rd_rel).relname.data.as_ptr();
            let context = pg_sys::deparse_context_for(relname, (*rel).rd_id);
            let printed = pg_sys::deparse_expression(expr, context, false, false);
            std::ffi::CStr::from_ptr(printed).to_string_lossy().into_owned()
        });
        Canonical { text, expr }
    }
}

/// Records what the key uses (functions, operators, types, collations, the table's columns) as dependencies of the
/// table's attachment trigger, as PostgreSQL records an index expression's: dropping one of them is refused, or,
/// with CASCADE, takes the trigger (and so the attachment) with it. A key that uses a temporary object is refused:
/// the object, and with it the trigger, would go at the end of its session without a DROP pg_dedup could follow.
///
/// # Safety
/// Table `relid` must be locked, with the attachment trigger just created on it, and `key` analysed against it.
pub unsafe fn record_dependencies(relid: pg_sys::Oid, key: &Canonical, table: &str) {
    let name = CString::new(super::TRIGGER).expect("no NUL in the trigger's name");
    // SAFETY: the caller vouches for the table and the expression; the trigger exists (missing_ok = false).
    let trigger = unsafe {
        let trigger = pg_sys::get_trigger_oid(relid, name.as_ptr(), false);
        let address = pg_sys::ObjectAddress { classId: pg_sys::TriggerRelationId, objectId: trigger, objectSubId: 0 };
        pg_sys::recordDependencyOnSingleRelExpr(
            &address,
            key.expr,
            relid,
            pg_sys::DependencyType::DEPENDENCY_NORMAL,
            pg_sys::DependencyType::DEPENDENCY_NORMAL,
            false,
        );
        pg_sys::CommandCounterIncrement();
        trigger
    };
    let temporary: Option<String> = Spi::get_one_with_args(
        "SELECT pg_catalog.string_agg(pg_catalog.pg_describe_object(d.refclassid, d.refobjid, d.refobjsubid), ', ')
           FROM pg_catalog.pg_depend d
          WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_trigger'::pg_catalog.regclass
            AND d.objid OPERATOR(pg_catalog.=) $1
            AND (pg_catalog.pg_identify_object(d.refclassid, d.refobjid, 0)).schema OPERATOR(pg_catalog.~) '^pg_temp'",
        &[trigger.into()],
    )
    .unwrap_or_else(|e| crate::errors::internal("reading the key's dependencies", e));
    if let Some(objects) = temporary {
        raise(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            format!("the key of {table} uses temporary objects: {objects}"),
            "A temporary object goes at the end of its session, and the table's deduplication with it; use permanent \
             functions and types in the key.",
        )
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
        table: &str,
        parent: pg_sys::MemoryContext,
        hint: impl Fn() -> String,
    ) -> Key {
        // SAFETY: everything is allocated in the new context, made under the current (transaction's) one so that a
        // key that fails to compile leaves nothing behind; only a compiled key moves under `parent`, owned by the
        // Key. The caller's context comes back.
        unsafe {
            let context = pg_sys::AllocSetContextCreateExtended(
                pg_sys::CurrentMemoryContext,
                c"dedup attachment key".as_ptr(),
                pg_sys::ALLOCSET_SMALL_MINSIZE as usize,
                pg_sys::ALLOCSET_SMALL_INITSIZE as usize,
                pg_sys::ALLOCSET_SMALL_MAXSIZE as usize,
            );
            let caller = pg_sys::MemoryContextSwitchTo(context);
            let analysed = guc::with_setting(c"search_path", KEY_SEARCH_PATH, || analyse(rel, text, table, hint));
            let expr = pg_sys::expression_planner(analysed as *mut pg_sys::Expr);
            let state = pg_sys::ExecInitExpr(expr, std::ptr::null_mut());
            let econtext = pg_sys::CreateStandaloneExprContext();
            pg_sys::MemoryContextSwitchTo(caller);
            pg_sys::MemoryContextSetParent(context, parent);
            Key { context, state, econtext, busy: std::cell::Cell::new(false) }
        }
    }

    /// The key of the row in `slot` (None: NULL), passed to `f` (it lives until `f` returns).
    ///
    /// # Safety
    /// `slot` must hold a row of the table the key was compiled for.
    pub unsafe fn eval<R>(
        &self,
        slot: *mut pg_sys::TupleTableSlot,
        table: &str,
        f: impl FnOnce(Option<&str>) -> R,
    ) -> R {
        if self.busy.replace(true) {
            raise(
                PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
                format!("the key of {table} inserted a row into {table} while it was being computed"),
                "A key must compute text from the row, not write to the table it deduplicates: change the key's \
                 functions, or attach the table with another key.",
            )
        }
        /// Frees the row's memory and the key once the value is used, on every path out (an ERROR included).
        struct Done<'a>(&'a Key);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                // SAFETY: the expression context's per-row memory holds only this evaluation's values.
                unsafe { pg_sys::MemoryContextReset((*self.0.econtext).ecxt_per_tuple_memory) };
                self.0.busy.set(false);
            }
        }
        let _done = Done(self);
        // SAFETY: evaluates the compiled expression over the row, in the expression context's per-row memory,
        // which `_done` resets once `f` is done with the value.
        unsafe {
            (*self.econtext).ecxt_scantuple = slot;
            let caller = pg_sys::MemoryContextSwitchTo((*self.econtext).ecxt_per_tuple_memory);
            let mut null = false;
            let evalfunc = (*self.state).evalfunc.expect("a compiled expression has an evaluation function");
            // Guarded: an ERROR raised inside (by a function of the key) comes back as a Rust unwind, which
            // runs `_done`, instead of a longjmp over these frames.
            let datum = pg_sys::ffi::pg_guard_ffi_boundary(|| evalfunc(self.state, self.econtext, &mut null));
            pg_sys::MemoryContextSwitchTo(caller);
            let key = (!null).then(|| {
                let text = pg_sys::pg_detoast_datum_packed(datum.cast_mut_ptr());
                pgrx::varlena::text_to_rust_str_unchecked(text)
            });
            f(key)
        }
    }
}
