//! Prepared statements kept for the life of a backend: a module lists its statements with `statements!`, which
//! declares `enum Stmt` and `Stmt::COUNT`, and keeps their plans in a `Plans<{ Stmt::COUNT }>`, prepared on first
//! use. The array of plans is sized by the list itself, so no count is kept by hand.

use crate::errors::internal;
use pgrx::spi::{OwnedPreparedStatement, SpiClient};
use pgrx::PgOid;
use std::cell::OnceCell;

/// Declares `pub enum Stmt`, one variant per statement (with its doc), and `Stmt::COUNT`.
macro_rules! statements {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Stmt {
            $($(#[$doc])* $name,)*
        }

        impl Stmt {
            /// How many statements there are: one cached plan each.
            pub const COUNT: usize = [$(Stmt::$name),*].len();
        }
    };
}
pub(crate) use statements;

/// The plans of `N` statements, each prepared the first time it is asked for.
pub struct Plans<const N: usize>([OnceCell<OwnedPreparedStatement>; N]);

impl<const N: usize> Default for Plans<N> {
    fn default() -> Self {
        Plans(std::array::from_fn(|_| OnceCell::new()))
    }
}

impl<const N: usize> Plans<N> {
    /// The plan of statement number `index`, prepared from `sql()` with `arg_types` on first use.
    pub fn get(
        &self,
        client: &SpiClient<'_>,
        index: usize,
        sql: impl FnOnce() -> String,
        arg_types: impl FnOnce() -> Vec<PgOid>,
    ) -> &OwnedPreparedStatement {
        self.0[index].get_or_init(|| {
            client
                .prepare_mut(sql().as_str(), &arg_types())
                .unwrap_or_else(|e| internal("preparing a statement", e))
                .keep()
        })
    }
}
