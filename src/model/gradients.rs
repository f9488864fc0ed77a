//! Where a backward pass hands the parameters' gradients, and when it is done with them.

use candle_core::Tensor;

use crate::Result;

/// Receives a backward pass's parameter gradients.
///
/// An engine hands over each parameter's gradient once per pass, and says when the parameters
/// handed over so far are [settled](GradientSink::settled): their gradients are complete and
/// the pass will not read their weights again, so an update may change them at once (the
/// update in backward, [`crate::knobs::Update::InBackward`]).
pub trait GradientSink {
    /// The gradient of model parameter `index` (in `model.params().vars()` order), in the
    /// parameter's dtype.
    fn gradient(&mut self, index: usize, grad: Tensor) -> Result<()>;

    /// The parameters whose gradients were handed over so far are done with for this pass.
    fn settled(&mut self) -> Result<()> {
        Ok(())
    }
}

/// A function of `(index, gradient)` is a sink that never updates during the pass.
impl<F: FnMut(usize, Tensor) -> Result<()>> GradientSink for F {
    fn gradient(&mut self, index: usize, grad: Tensor) -> Result<()> {
        self(index, grad)
    }
}
