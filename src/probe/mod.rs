//! Probing: short real training trials that measure one setting, or report that it ran out of
//! memory. Every way of running them is a [`Prober`] (the core's trait), so the search never
//! knows which one it drives.
//!
//! Where a trial runs: in this process ([`live`]), in a fresh child process ([`child`]), or in
//! a long-lived child that serves trial after trial while it stays clean ([`worker`]). Each
//! protocol's two halves, the parent's prober and the child's server, sit in one file; both
//! exchange a [`job::TrialJob`]. Data-parallel trials run as several ranks
//! (`crate::dist::probe`), recorded ones are answered by the core's `ReplayProber`. Trials of
//! another framework are asked of a trial runner, any program that speaks the trial protocol
//! ([`exec`], through the runner processes of [`runner`], each killed with its whole
//! [`tree`]), and by a [`watchdog`] when autotune itself is killed). A trial process ends with
//! the autotune that started it ([`lifetime`]).
//! [`crate::backend::host_memory`] counts the host memory a trial takes, and [`host_work`]
//! measures the host update that bounds offloaded regimes before their first trial.

pub mod child;
pub mod exec;
pub mod floor;
pub mod host_work;
pub mod job;
pub mod lifetime;
pub mod live;
pub mod oom;
pub mod runner;
pub mod timeout;
pub mod timing;
pub mod tree;
pub mod watchdog;
pub mod worker;

pub use crate::trial::Prober;
