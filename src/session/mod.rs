//! The sessions the commands run, from validated settings ([`crate::settings`]) to a finished
//! job: a training run in this process, as a rank, or as the launcher of its ranks, and the
//! directories a run owns. The library never prints: a session tells what happens through a
//! [`observer::SessionObserver`], and the binary decides what people see.

pub mod launch;
pub mod observer;
pub mod run_dir;
pub mod train;
