//! The sessions the commands run: tuning now, training later. A session takes a command's
//! validated settings ([`crate::settings`]), runs it to the end and returns what it found;
//! it prints nothing, and tells its caller what happens as it goes through an observer.
//!
//! [`tune`] replays a recording or searches on this machine; [`prober`] assembles the prober
//! a search on this machine runs its trials with.

pub mod prober;
pub mod tune;
