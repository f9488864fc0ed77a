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

    /// Rows `first..first + grad.dim(0)` of parameter `index`'s gradient (a matrix's), in the
    /// parameter's dtype. Only a pass asked for the vocabulary head's weight gradient by rows
    /// ([`crate::model::HeadGradient::ByRows`]) hands a gradient over in parts; a sink that
    /// takes whole gradients refuses them.
    fn gradient_rows(&mut self, index: usize, first: usize, grad: Tensor) -> Result<()> {
        let _ = (first, grad);
        Err(crate::Error::internal(format!(
            "parameter {index}'s gradient came in rows to a sink that takes whole gradients"
        )))
    }

    /// The parameters whose gradients were handed over so far are done with for this pass.
    fn settled(&mut self) -> Result<()> {
        Ok(())
    }

    /// As [`GradientSink::settled`], at a finer grain: one layer of a block, or one slice of
    /// the head's rows. A sink that frees memory as soon as it can acts on it; the others wait
    /// for the part's [`GradientSink::settled`].
    fn settled_layer(&mut self) -> Result<()> {
        Ok(())
    }
}

/// A function of `(index, gradient)` is a sink that never updates during the pass.
impl<F: FnMut(usize, Tensor) -> Result<()>> GradientSink for F {
    fn gradient(&mut self, index: usize, grad: Tensor) -> Result<()> {
        self(index, grad)
    }
}
