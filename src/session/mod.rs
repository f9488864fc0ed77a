//! The sessions the commands run, from validated settings ([`crate::settings`]) to a finished
//! job: a search ([`tune`], with the prober [`prober`] assembles), a training run in this
//! process, as a rank, or as the launcher of its ranks ([`train`], [`launch`]), and the
//! directories a run owns ([`run_dir`]). The library never prints: a session tells what happens
//! through an observer ([`observer::SessionObserver`], [`tune::TuneObserver`]), and the binary
//! decides what people see.

pub mod check;
pub mod data;
pub mod estimate;
pub mod launch;
pub mod observer;
pub mod probe;
pub mod prober;
pub mod run_dir;
pub mod train;
pub mod tune;
