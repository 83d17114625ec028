//! `Jsonb`: a jsonb value passed through untouched. pgrx's own `JsonB` parses every value into serde_json and
//! serialises it back; a stored result (up to `MAX_RESULT_BYTES`) only goes into a row and out again, so it stays
//! the varlena PostgreSQL gave us.

use pgrx::callconv::{Arg, ArgAbi, BoxRet, FcInfo};
use pgrx::nullable::Nullable;
use pgrx::pgrx_sql_entity_graph::metadata::{
    ArgumentError, ReturnsError, ReturnsRef, SqlMappingRef, SqlTranslatable, TypeOrigin,
};
use pgrx::prelude::*;

/// A jsonb datum, valid in the memory context it was read in (an argument: for the call; a value read through SPI:
/// see `Jsonb::from_spi`).
#[derive(Clone, Copy)]
pub struct Jsonb(pg_sys::Datum);

impl Jsonb {
    /// Its size once decompressed and fetched from TOAST, header included.
    pub fn size(&self) -> usize {
        // SAFETY: a jsonb varlena, possibly toasted.
        unsafe { pg_sys::toast_raw_datum_size(self.0) }
    }

    /// The datum.
    pub fn datum(&self) -> pg_sys::Datum {
        self.0
    }

    /// `text` parsed as jsonb, in the current memory context (a clean ERROR if it is not JSON).
    pub fn parse(text: &str) -> Jsonb {
        let text = std::ffi::CString::new(text).expect("JSON text has no NUL");
        // SAFETY: jsonb_in takes a NUL-terminated C string and returns a palloc'd jsonb.
        let datum =
            unsafe { pgrx::direct_function_call::<pg_sys::Datum>(pg_sys::jsonb_in, &[text.as_c_str().into_datum()]) };
        Jsonb(datum.expect("jsonb_in returns a value"))
    }

    /// A detoasted copy of `datum` in the current memory context, independent of the tuple or buffer it was read
    /// from.
    ///
    /// # Safety
    /// `datum` must be a jsonb varlena.
    pub unsafe fn copy_of(datum: pg_sys::Datum) -> Jsonb {
        // SAFETY: the caller vouches for the datum; the copy is palloc'd.
        Jsonb(pg_sys::Datum::from(unsafe { pg_sys::pg_detoast_datum_copy(datum.cast_mut_ptr()) }))
    }

    /// Copies a jsonb value read through SPI out of SPI's memory (detoasted), into the memory context that was
    /// current when the SPI connection was opened: it outlives the connection.
    ///
    /// # Safety
    /// Inside an SPI connection; `datum` must be a jsonb varlena.
    pub unsafe fn from_spi(datum: pg_sys::Datum) -> Jsonb {
        // SAFETY: the caller vouches for the datum; SPI_palloc allocates in the upper context.
        unsafe {
            let detoasted = pg_sys::pg_detoast_datum_packed(datum.cast_mut_ptr());
            let len = pgrx::varlena::varsize_any(detoasted);
            let copy = pg_sys::SPI_palloc(len);
            std::ptr::copy_nonoverlapping(detoasted as *const u8, copy as *mut u8, len);
            Jsonb(pg_sys::Datum::from(copy))
        }
    }
}

impl FromDatum for Jsonb {
    unsafe fn from_polymorphic_datum(datum: pg_sys::Datum, is_null: bool, _: pg_sys::Oid) -> Option<Jsonb> {
        (!is_null).then_some(Jsonb(datum))
    }
}

impl IntoDatum for Jsonb {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(self.0)
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::JSONBOID
    }
}

// SAFETY: a jsonb argument is a varlena datum, which `from_polymorphic_datum` keeps as it is.
unsafe impl<'fcx> ArgAbi<'fcx> for Jsonb {
    unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
        // SAFETY: pgrx calls this for a non-NULL argument of this type only.
        unsafe { arg.unbox_arg_using_from_datum().expect("a non-NULL argument") }
    }

    unsafe fn unbox_nullable_arg(arg: Arg<'_, 'fcx>) -> Nullable<Self> {
        // SAFETY: as above; NULL comes back as None.
        unsafe { arg.unbox_arg_using_from_datum() }.into()
    }
}

// SAFETY: maps to SQL's jsonb, the type of the datums it carries.
unsafe impl SqlTranslatable for Jsonb {
    const TYPE_IDENT: &'static str = pgrx::pgrx_resolved_type!(Jsonb);
    const TYPE_ORIGIN: TypeOrigin = TypeOrigin::External;
    const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> = Ok(SqlMappingRef::literal("jsonb"));
    const RETURN_SQL: Result<ReturnsRef, ReturnsError> = Ok(ReturnsRef::One(SqlMappingRef::literal("jsonb")));
}

// SAFETY: returns the datum as it is, a jsonb varlena valid for as long as the caller's memory context.
unsafe impl BoxRet for Jsonb {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> pgrx::datum::Datum<'fcx> {
        // SAFETY: a non-NULL datum of the function's declared return type.
        unsafe { fcinfo.return_raw_datum(self.0) }
    }
}
