//! Reservations and active load. (Lands with issue 4.)
