// The page's contents open from the list button in the article's header at every
// width. The theme wires only its first "secondary-toggle" button (in the site header,
// which this book does not show), so the article header's button passes its click on.
document.addEventListener("DOMContentLoaded", function () {
  var buttons = document.querySelectorAll("button.secondary-toggle");
  buttons.forEach(function (button, i) {
    if (i === 0) return;
    button.addEventListener("click", function (event) {
      event.preventDefault();
      event.stopPropagation();
      buttons[0].click();
    });
  });
});
