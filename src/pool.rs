//! Bounded pools of reusable buffers.
//!
//! Token arrays of 100k–1M entries arrive on every selection request. Allocating
//! a fresh `Vec<u32>` each time costs a page-faulting `mmap` for large prompts, so
//! the parser writes into buffers taken from a [`Pool`]. A [`Pooled`] buffer goes
//! back to its pool when dropped.
//!
//! Invariants:
//! - at most `max_buffers` idle buffers are kept;
//! - a buffer whose capacity grew past `max_capacity` is freed on drop instead of
//!   being kept, so one 1M-token request does not pin memory forever;
//! - a returned buffer is cleared, never read back with stale contents.

use parking_lot::Mutex;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// Default number of idle buffers a pool keeps.
pub const DEFAULT_MAX_BUFFERS: usize = 64;
/// Default largest capacity (in elements) an idle buffer may keep: 256k entries
/// (1 MiB of `u32`), enough for a typical 100k–200k token prompt.
pub const DEFAULT_MAX_CAPACITY: usize = 256 * 1024;

/// A bounded, thread-safe pool of `Vec<T>` buffers. Cloning shares the pool.
pub struct Pool<T> {
    inner: Arc<Inner<T>>,
}

struct Inner<T> {
    idle: Mutex<Vec<Vec<T>>>,
    max_buffers: usize,
    max_capacity: usize,
}

impl<T> Clone for Pool<T> {
    fn clone(&self) -> Self {
        Pool {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T> fmt::Debug for Pool<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("idle", &self.idle_count())
            .field("max_buffers", &self.inner.max_buffers)
            .field("max_capacity", &self.inner.max_capacity)
            .finish()
    }
}

impl<T> Default for Pool<T> {
    fn default() -> Self {
        Pool::new(DEFAULT_MAX_BUFFERS, DEFAULT_MAX_CAPACITY)
    }
}

impl<T> Pool<T> {
    /// A pool keeping at most `max_buffers` idle buffers of at most
    /// `max_capacity` elements each.
    pub fn new(max_buffers: usize, max_capacity: usize) -> Self {
        Pool {
            inner: Arc::new(Inner {
                idle: Mutex::new(Vec::with_capacity(max_buffers.min(1024))),
                max_buffers,
                max_capacity,
            }),
        }
    }

    /// Takes an empty buffer, reusing an idle one when there is one.
    pub fn take(&self) -> Pooled<T> {
        let buf = self.inner.idle.lock().pop().unwrap_or_default();
        debug_assert!(buf.is_empty());
        Pooled {
            buf,
            pool: Some(Arc::clone(&self.inner)),
        }
    }

    /// Number of idle buffers currently held.
    pub fn idle_count(&self) -> usize {
        self.inner.idle.lock().len()
    }

    /// Total capacity, in elements, of the idle buffers held.
    pub fn idle_capacity(&self) -> usize {
        self.inner.idle.lock().iter().map(Vec::capacity).sum()
    }
}

/// A buffer on loan from a [`Pool`]; dereferences to `Vec<T>` and returns to the
/// pool on drop.
pub struct Pooled<T> {
    buf: Vec<T>,
    pool: Option<Arc<Inner<T>>>,
}

impl<T> Pooled<T> {
    /// A buffer that belongs to no pool (dropped normally). Useful for tests and
    /// for values built outside the request path.
    pub fn detached(buf: Vec<T>) -> Self {
        Pooled { buf, pool: None }
    }

    /// Takes the vector out; it will not return to the pool.
    pub fn into_vec(mut self) -> Vec<T> {
        self.pool = None;
        std::mem::take(&mut self.buf)
    }
}

impl<T> Default for Pooled<T> {
    fn default() -> Self {
        Pooled::detached(Vec::new())
    }
}

impl<T> Deref for Pooled<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.buf
    }
}

impl<T> DerefMut for Pooled<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.buf
    }
}

impl<T: fmt::Debug> fmt::Debug for Pooled<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.buf.fmt(f)
    }
}

impl<T: PartialEq> PartialEq for Pooled<T> {
    fn eq(&self, other: &Self) -> bool {
        self.buf == other.buf
    }
}

impl<T> Drop for Pooled<T> {
    fn drop(&mut self) {
        let Some(pool) = self.pool.take() else {
            return;
        };
        if self.buf.capacity() == 0 || self.buf.capacity() > pool.max_capacity {
            return;
        }
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        let mut idle = pool.idle.lock();
        if idle.len() < pool.max_buffers {
            idle.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_returns_to_pool_on_drop_and_is_cleared() {
        let pool: Pool<u32> = Pool::new(2, 1024);
        {
            let mut b = pool.take();
            b.extend([1, 2, 3]);
        }
        assert_eq!(pool.idle_count(), 1);
        let b = pool.take();
        assert!(b.is_empty());
        assert!(b.capacity() >= 3);
        assert_eq!(pool.idle_count(), 0);
    }

    #[test]
    fn oversized_buffers_are_not_kept() {
        let pool: Pool<u32> = Pool::new(4, 16);
        {
            let mut b = pool.take();
            b.extend(0..1000);
        }
        assert_eq!(pool.idle_count(), 0);
    }

    #[test]
    fn idle_count_is_bounded() {
        let pool: Pool<u64> = Pool::new(2, 1024);
        let bufs: Vec<_> = (0..5)
            .map(|_| {
                let mut b = pool.take();
                b.push(1);
                b
            })
            .collect();
        drop(bufs);
        assert_eq!(pool.idle_count(), 2);
    }

    #[test]
    fn detached_and_into_vec_do_not_return() {
        let pool: Pool<u32> = Pool::new(2, 1024);
        let mut b = pool.take();
        b.push(9);
        let v = b.into_vec();
        assert_eq!(v, vec![9]);
        assert_eq!(pool.idle_count(), 0);
    }
}
