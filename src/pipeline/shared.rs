//! The shared reader: one file read per input block for all lanes.
//!
//! Lanes run in phase ([`TileQueue`](super::stages::TileQueue)), so several lanes ask for the
//! same B block at about the same time. The first staging thread to ask reads it into a buffer
//! of its own pool and publishes it here; the others wait for that read instead of issuing their
//! own and upload the same host buffer (the lease is reference-counted and goes back to its pool
//! when the last upload of it has completed). Out of core this is the difference between reading
//! B once and once per device.
//!
//! Entries are kept until every lane has taken them, or until their owner needs the buffer back:
//! a staging thread whose pool is empty first evicts its own oldest published entries ([`evict_one`]), so
//! sharing never holds memory that the reader needs to make progress, and the budget is the pools'
//! as before.
//!
//! [`evict_one`]: SharedReads::evict_one

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::control::Control;
use super::pool::Lease;
use crate::error::{Error, Result};
use crate::plan::schedule::Src;
use crate::store::Block;

type Key = (Src, u64, u64, u64, u64);

fn key(src: Src, b: &Block) -> Key {
    (src, b.r0, b.c0, b.rows, b.cols)
}

enum Slot {
    /// A staging thread is reading it now.
    Reading,
    /// Read; `takers` lanes have taken it so far.
    Ready {
        buf: Arc<Lease>,
        owner: usize,
        takers: usize,
    },
}

#[derive(Default)]
struct State {
    map: HashMap<Key, Slot>,
    /// Ready keys, oldest first (for the capacity limit).
    fifo: VecDeque<Key>,
}

pub(crate) struct SharedReads {
    lanes: usize,
    /// Most ready entries kept at once.
    cap: usize,
    st: Mutex<State>,
    cv: Condvar,
    /// Bytes a lane took from another lane's read instead of reading them (file dtype).
    pub(crate) shared_bytes: AtomicU64,
}

/// What [`SharedReads::get`] found.
pub(crate) enum Got {
    /// Another lane's read of this block.
    Shared(Arc<Lease>),
    /// Nobody has it, and the caller claimed the read: it must read it and then
    /// [`SharedReads::publish`] (or [`SharedReads::abandon`] on error).
    Read,
    /// Nobody has it, and the caller did not claim it (`claim` false).
    Absent,
}

impl SharedReads {
    pub(crate) fn new(lanes: usize, cap: usize) -> SharedReads {
        SharedReads {
            lanes,
            cap: cap.max(1),
            st: Mutex::new(State::default()),
            cv: Condvar::new(),
            shared_bytes: AtomicU64::new(0),
        }
    }

    /// Sharing is pointless with one lane.
    pub(crate) fn enabled(&self) -> bool {
        self.lanes > 1
    }

    /// Take block `b` of `src` if another lane read it, wait if one is reading it, or else —
    /// with `claim` — claim the read.
    ///
    /// Claim only with a buffer in hand: lanes wait for a claimed read, so a claim made before
    /// leasing would make them wait for the claimer's pool, and a slow lane's pool is empty most
    /// of the time. Four simulated lanes, one twenty times slower, once split a run's GEMMs
    /// [35, 65, 295, 210], most likely that way: the fast lane in phase with the slow one held
    /// behind it (tests/it/sim.rs; not reproduced in twenty local runs).
    pub(crate) fn get(&self, ctl: &Control, src: Src, b: &Block, claim: bool) -> Result<Got> {
        let k = key(src, b);
        let mut st = self.st.lock().unwrap();
        loop {
            match st.map.get_mut(&k) {
                Some(Slot::Ready { buf, takers, .. }) => {
                    *takers += 1;
                    let buf = buf.clone();
                    if *takers >= self.lanes {
                        st.map.remove(&k);
                    }
                    return Ok(Got::Shared(buf));
                }
                Some(Slot::Reading) => {
                    if ctl.is_cancelled() {
                        return Err(Error::Cancelled);
                    }
                    st = self
                        .cv
                        .wait_timeout(st, Duration::from_millis(20))
                        .unwrap()
                        .0;
                }
                None if claim => {
                    st.map.insert(k, Slot::Reading);
                    return Ok(Got::Read);
                }
                None => return Ok(Got::Absent),
            }
        }
    }

    /// The read claimed by [`get`](Self::get) is done: let the other lanes have it.
    pub(crate) fn publish(&self, src: Src, b: &Block, buf: &Arc<Lease>, owner: usize) {
        let k = key(src, b);
        let mut st = self.st.lock().unwrap();
        st.map.insert(
            k,
            Slot::Ready {
                buf: buf.clone(),
                owner,
                takers: 1,
            },
        );
        st.fifo.push_back(k);
        while st.fifo.len() > self.cap {
            let old = st.fifo.pop_front().expect("non-empty");
            if matches!(st.map.get(&old), Some(Slot::Ready { .. })) {
                st.map.remove(&old);
            }
        }
        self.cv.notify_all();
    }

    /// The claimed read failed: let a waiting lane try it itself.
    pub(crate) fn abandon(&self, src: Src, b: &Block) {
        self.st.lock().unwrap().map.remove(&key(src, b));
        self.cv.notify_all();
    }

    /// Drop the oldest published entry whose buffer came from `owner`'s pool, so that it goes
    /// back to that pool once the lanes that took it are done; false if there is none.
    pub(crate) fn evict_one(&self, owner: usize) -> bool {
        let mut st = self.st.lock().unwrap();
        let State { map, fifo } = &mut *st;
        let Some(pos) = fifo
            .iter()
            .position(|k| matches!(map.get(k), Some(Slot::Ready { owner: o, .. }) if *o == owner))
        else {
            return false;
        };
        let k = fifo.remove(pos).expect("position is in range");
        map.remove(&k);
        true
    }

    pub(crate) fn count_shared(&self, bytes: u64) {
        self.shared_bytes.fetch_add(bytes, Ordering::Relaxed);
    }
}
