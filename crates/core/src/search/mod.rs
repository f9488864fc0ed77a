//! The search: which trials to run, in what order, and which setting to choose.
//!
//! [`driver::SearchDriver`] decides (pure: history in, next action out); [`run::run_search`] is
//! the only loop, calling a [`Prober`](crate::trial::Prober) and a [`report::Reporter`]; [`sim::Simulator`]
//! answers trials from closed-form laws for tests, benches and dry runs.
//!
//! ```
//! use autotune_core::knobs::{Knobs, Precision};
//! use autotune_core::search::sim::{Law, SimRegime, Simulator};
//! use autotune_core::search::{
//!     run_search, Decision, MachineFacts, NoReporter, SearchDriver, SearchSpace,
//! };
//! use autotune_core::spec::budget::Budget;
//!
//! let regime = Knobs::new(1, Precision::Bf16).regime();
//! let budget = Budget { gpu_bytes: Some(10 << 30), host_bytes: 32 << 30, headroom: 0.05 };
//! // Peak device memory 1 GiB + 37 MiB per sequence; 10 ms + 2 ms per sequence per step.
//! let laws = SimRegime {
//!     regime,
//!     gpu_bytes: Law::affine((1u64 << 30) as f64, (37u64 << 20) as f64),
//!     host_bytes: Law::affine((2u64 << 30) as f64, 0.0),
//!     step_time_s: Law::affine(0.010, 0.002),
//! };
//! let mut device = Simulator::with_budget(&budget, 1024, vec![laws]);
//! let driver = SearchDriver::new(SearchSpace::new(vec![regime]), MachineFacts::default(), budget)?;
//! let outcome = run_search(&driver, &mut device, &NoReporter)?;
//! assert_eq!(outcome.decision, Decision::Chosen(Knobs::new(235, Precision::Bf16)));
//! assert_eq!(outcome.history.len(), 11); // 10 search trials and the verification
//! # Ok::<(), autotune_core::Error>(())
//! ```

pub mod decision;
pub mod driver;
pub mod facts;
mod hint;
mod relatives;
pub mod report;
pub mod run;
pub mod setup;
pub mod sim;
pub mod space;
pub mod way_out;

pub use decision::{
    AccumulationRuledOut, Candidate, Decision, Next, RegimeEnd, RegimeProgress, RegimeState,
};
pub use driver::SearchDriver;
pub use facts::{AccumulationExtra, MachineFacts};
pub use report::{Event, NoReporter, Purpose, Reporter};
pub use run::{run_search, SearchOutcome};
pub use setup::{Runtime, SearchSetup};
pub use space::{SearchSpace, SpaceRequest};
